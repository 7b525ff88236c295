"""The sampler: sliding-window minimum, per-rank errors, and its thread."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_agent.gpu import GpuReading, ProcessMemory, RankDevice
from rankguard_agent.gpu.nvml import NvmlBackend
from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import remove_proc, write_device, write_proc
from rankguard_agent.others import PodProcesses
from rankguard_agent.sampler import Sampler, WindowMin
from rankguard_sim.waiting import wait_for
from tests.unit.agent.gpu.test_nvml import FakeGpu, fake_nvml

GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_device(tmp_path, "GPU-0", index=0, total_bytes=80 * GIB)
    write_device(tmp_path, "GPU-1", index=1, total_bytes=80 * GIB)
    return tmp_path


def test_window_min_forgets_values_older_than_the_window() -> None:
    w = WindowMin(10.0)
    w.push(0.0, 50)
    w.push(1.0, 70)
    w.push(2.0, 60)
    assert w.min() == 50
    w.evict(10.5)
    assert w.min() == 60
    w.evict(100.0)
    assert w.min() == 60  # the newest value stays: it is the last thing known
    assert len(w) == 1


@given(
    st.lists(st.tuples(st.floats(0, 5), st.integers(0, 1000)), min_size=1, max_size=200), st.floats(0.5, 30)
)
def test_window_min_equals_brute_force(steps: list[tuple[float, int]], window: float) -> None:
    w = WindowMin(window)
    t = 0.0
    history: list[tuple[float, int]] = []
    for dt, value in steps:
        t += dt
        w.push(t, value)
        history.append((t, value))
        in_window = [v for (ts, v) in history if ts >= t - window]
        assert w.min() == min(in_window)
        assert len(w) <= len(in_window)


def test_min_free_catches_a_transient_peak_until_it_leaves_the_window(root: Path) -> None:
    clock = Clock()
    s = Sampler(SimBackend(root, {}), hz=10, window_seconds=5, clock=clock)
    s.sample_once()
    write_proc(root, "GPU-1", "vllm", 30 * GIB)  # a short peak on rank 1
    clock.now += 0.1
    s.sample_once()
    remove_proc(root, "GPU-1", "vllm")
    clock.now += 0.1
    s.sample_once()
    snap = s.snapshot()
    assert [r.rank for r in snap] == [0, 1]
    assert snap[1].free_bytes == 80 * GIB
    assert snap[1].min_free_bytes == 50 * GIB
    assert snap[0].min_free_bytes == 80 * GIB
    assert snap[1].window_seconds == 5
    clock.now += 6
    s.sample_once()
    assert s.snapshot()[1].min_free_bytes == 80 * GIB
    assert s.samples_total == 8 and s.errors_total == 0


def test_lost_gpu_keeps_last_good_figures_and_logs_once(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    s = Sampler(SimBackend(root, {}), window_seconds=5, clock=clock)
    write_proc(root, "GPU-0", "vllm", 10 * GIB)
    s.sample_once()
    write_device(root, "GPU-0", index=0, total_bytes=80 * GIB, lost=True)
    with caplog.at_level(logging.ERROR, logger="rankguard_agent.sampler"):
        for _ in range(5):
            clock.now += 0.1
            s.sample_once()
    lost, other = s.snapshot()
    assert lost.error == "GpuIsLost"
    assert (lost.free_bytes, lost.used_bytes, lost.total_bytes) == (70 * GIB, 10 * GIB, 80 * GIB)
    assert other.error is None and other.free_bytes == 80 * GIB
    assert s.errors_total == 5
    assert len([r for r in caplog.records if "GpuIsLost" in r.getMessage()]) == 1


class ExplodingBackend:
    """A backend whose rank 1 raises: a bug there must not stop rank 0's readings."""

    name = "exploding"

    def ranks(self) -> list[RankDevice]:
        return [RankDevice(0, "GPU-0"), RankDevice(1, "GPU-1")]

    def read(self, rank: int) -> GpuReading:
        if rank == 1:
            raise RuntimeError("driver said something odd")
        return GpuReading(0, "GPU-0", 100, 40, 60)

    def processes(self, rank: int) -> list[ProcessMemory] | None:
        return []

    def vmm_supported(self) -> bool | None:
        return None

    def close(self) -> None:
        return None


def test_a_raising_backend_becomes_that_ranks_error() -> None:
    s = Sampler(ExplodingBackend())
    s.sample_once()
    ok, broken = s.snapshot()
    assert ok.error is None and ok.free_bytes == 60
    assert broken.error is not None and "driver said something odd" in broken.error
    assert (broken.free_bytes, broken.min_free_bytes) == (0, 0)


class ReadTimes(SimBackend):
    """The sim backend, recording when (monotonic) each tick read rank 0."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, {})
        self.reads: list[float] = []

    def read(self, rank: int) -> GpuReading:
        if rank == 0:
            self.reads.append(time.monotonic())
        return super().read(rank)


def test_thread_samples_paced_never_bursting_and_stops(root: Path) -> None:
    backend = ReadTimes(root)
    s = Sampler(backend, hz=20, window_seconds=5)
    assert not s.is_up()
    s.start()
    try:
        wait_for("the sampler to tick", lambda: s.ticks_total >= 5 and s.is_up(), timeout=30, every=0.02)
        started = s.ticks_total
        wait_for("ten more ticks", lambda: s.ticks_total >= started + 10, timeout=30, every=0.02)
    finally:
        s.stop()
    # Paced at 20 Hz: a busy machine may slow it (missed ticks are skipped), never speed it up.
    # Each tick waits for its slot and a late one moves the slots after it, so the reads it
    # recorded never crowd: n ticks after any one span at least n - 1 periods, however loaded.
    reads = backend.reads
    assert len(reads) >= 15
    crowded = [
        (i, j, reads[j] - reads[i])
        for i in range(len(reads))
        for j in range(i + 1, len(reads))
        if reads[j] - reads[i] < (j - i - 1) * s.period - 1e-3
    ]
    assert crowded == [], crowded[:5]
    assert s._thread is not None and not s._thread.is_alive()
    assert not s.is_up()  # a stopped sampler is not "up", whatever its last tick


def test_bad_rates_are_rejected(root: Path) -> None:
    with pytest.raises(ValueError):
        Sampler(SimBackend(root, {}), hz=0)


# -- others on the GPU (others.py), where the sampler samples --------------------------------


def test_others_on_the_gpu_are_sampled_with_the_pods_processes(root: Path, neighbour: int) -> None:
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_proc(root, "GPU-1", "vllm", 40 * GIB, pid=engine.pid)
        write_proc(root, "GPU-1", "cache", 5 * GIB, pid=neighbour)
        s = Sampler(SimBackend(root, {}), pod=PodProcesses())
        s.sample_once()
        first = s.snapshot()[1]
        assert (first.others_bytes, first.others_peak_bytes) == (None, None)  # one tick says nothing yet
        s.sample_once()
        quiet, busy = s.snapshot()
        assert (quiet.others_bytes, quiet.others_peak_bytes, quiet.others) == (0, 0, [])
        assert (busy.others_bytes, busy.others_peak_bytes) == (5 * GIB, 5 * GIB)
        assert [(o.pid, o.bytes) for o in busy.others] == [(neighbour, 5 * GIB)]
        assert busy.used_bytes == 45 * GIB  # the reading itself is unchanged
        remove_proc(root, "GPU-1", "cache", pid=neighbour)
        s.sample_once()
        s.sample_once()
        gone = s.snapshot()[1]
        assert (gone.others_bytes, gone.others_peak_bytes, gone.others) == (0, 5 * GIB, [])
    finally:
        engine.kill()
        engine.wait()


def test_without_the_pods_processes_others_are_unknown_and_never_listed(root: Path) -> None:
    listed: list[int] = []

    class Counting(SimBackend):
        def processes(self, rank: int) -> list[ProcessMemory] | None:
            listed.append(rank)
            return super().processes(rank)

    s = Sampler(Counting(root, {}))
    s.sample_once()
    s.sample_once()
    assert all((r.others_bytes, r.others_peak_bytes, r.others) == (None, None, []) for r in s.snapshot())
    assert listed == []  # `serve`: no driver call for a figure it cannot give


def test_others_through_nvml_are_what_the_pods_processes_do_not_account_for() -> None:
    """NVML lists only the pod's own pid namespace: another pod's memory is the remainder."""
    me = os.getpid()
    gpus = [
        FakeGpu("GPU-1111", free=20 * GIB, reserved=GIB, procs=[(me, 50 * GIB)]),
        FakeGpu("GPU-2222", free=20 * GIB, procs=[(me, None)]),  # NVML_VALUE_NOT_AVAILABLE
    ]
    s = Sampler(NvmlBackend(fake_nvml(gpus), {}), pod=PodProcesses())
    s.sample_once()
    s.sample_once()
    first, second = s.snapshot()
    assert (first.others_bytes, first.others_peak_bytes) == (9 * GIB, 9 * GIB)
    assert second.others_bytes is None and second.error is None


def test_the_load_start_keeps_the_last_reading_unless_it_is_old(root: Path) -> None:
    """`mark_load`: the last reading when it is from the last tick or so, else the next one; the
    first mark of an engine run stands until `reset_load`; without the pod's processes others'
    memory is unknown."""
    clock = Clock()
    s = Sampler(SimBackend(root, {}), hz=10, window_seconds=5, clock=clock)
    write_proc(root, "GPU-0", "vllm", 2 * GIB)
    s.sample_once()
    write_proc(root, "GPU-0", "vllm", 30 * GIB)  # after the reading: not seen at the mark
    clock.now += 0.1
    s.mark_load()
    assert [(r.free_at_load_bytes, r.others_at_load_bytes) for r in s.snapshot()] == [
        (78 * GIB, None),
        (80 * GIB, None),
    ]
    s.sample_once()
    s.mark_load()  # a second mark in the same run changes nothing
    assert [r.free_at_load_bytes for r in s.snapshot()] == [78 * GIB, 80 * GIB]
    s.reset_load()
    assert [r.free_at_load_bytes for r in s.snapshot()] == [None, None]
    clock.now += 5  # the sampler stalled: its last reading is no witness of now
    s.mark_load()
    assert [r.free_at_load_bytes for r in s.snapshot()] == [None, None]
    write_proc(root, "GPU-0", "vllm", 40 * GIB)
    s.sample_once()
    assert [r.free_at_load_bytes for r in s.snapshot()] == [40 * GIB, 80 * GIB]
