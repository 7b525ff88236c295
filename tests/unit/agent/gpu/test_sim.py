"""The sim backend over a real temporary GPU root laid out as docs/sim-world.md says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankguard_agent.gpu import GpuUnavailable, open_backend, resolve_backend_kind
from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import read_device, remove_proc, write_device, write_proc

GIB = 1 << 30


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for i, uuid in enumerate(["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]):
        write_device(
            tmp_path, uuid, index=i, total_bytes=80 * GIB, reserved_bytes=GIB // 2, comm_init_bytes=GIB
        )
    return tmp_path


def test_reading_is_reserved_plus_live_processes(root: Path) -> None:
    write_proc(root, "GPU-bbbb", "vllm", 30 * GIB)
    write_proc(root, "GPU-bbbb", "ghost", 7 * GIB, pid=dead_pid())
    b = SimBackend(root, {})
    r = b.read(1)
    assert r.error is None
    assert r.uuid == "GPU-bbbb"
    assert r.total_bytes == 80 * GIB
    assert r.used_bytes == GIB // 2 + 30 * GIB
    assert r.free_bytes == 80 * GIB - GIB // 2 - 30 * GIB
    assert r.reserved_bytes == GIB // 2
    assert [(p.pid, p.used_bytes) for p in b.processes(1) or []] == [(os.getpid(), 30 * GIB)]


def test_free_never_negative(root: Path) -> None:
    write_proc(root, "GPU-aaaa", "vllm", 200 * GIB)
    r = SimBackend(root, {}).read(0)
    assert r.free_bytes == 0 and r.used_bytes == 80 * GIB


def test_ranks_follow_nvidia_visible_devices_order(root: Path) -> None:
    b = SimBackend(root, {"NVIDIA_VISIBLE_DEVICES": "GPU-cccc,GPU-aaaa"})
    assert [d.uuid for d in b.ranks()] == ["GPU-cccc", "GPU-aaaa"]
    assert [d.rank for d in b.ranks()] == [0, 1]


def test_without_a_list_every_device_in_index_order(root: Path) -> None:
    write_device(root, "GPU-0000", index=3, total_bytes=GIB)
    (root / "not-a-gpu").mkdir()
    assert [d.uuid for d in SimBackend(root, {}).ranks()] == ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-0000"]


def test_cuda_visible_devices_applies_on_top(root: Path) -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb,GPU-cccc", "CUDA_VISIBLE_DEVICES": "2,GPU-aa"}
    assert [d.uuid for d in SimBackend(root, env).ranks()] == ["GPU-cccc", "GPU-aaaa"]


def test_changes_are_seen_at_once(root: Path) -> None:
    b = SimBackend(root, {})
    assert b.read(0).used_bytes == GIB // 2
    write_proc(root, "GPU-aaaa", "vllm", 10 * GIB)
    assert b.read(0).used_bytes == GIB // 2 + 10 * GIB
    write_proc(root, "GPU-aaaa", "vllm", 11 * GIB)  # same tick, same size class: still seen
    assert b.read(0).used_bytes == GIB // 2 + 11 * GIB
    remove_proc(root, "GPU-aaaa", "vllm")
    assert b.read(0).used_bytes == GIB // 2
    write_device(root, "GPU-aaaa", index=0, total_bytes=40 * GIB)
    assert b.read(0).total_bytes == 40 * GIB


def test_lost_gpu_is_that_ranks_error_only(root: Path) -> None:
    b = SimBackend(root, {})
    write_device(root, "GPU-bbbb", index=1, total_bytes=80 * GIB, lost=True)
    assert b.read(1).error == "GpuIsLost"
    assert b.read(0).error is None and b.read(2).error is None
    write_device(root, "GPU-bbbb", index=1, total_bytes=80 * GIB)
    assert b.read(1).error is None


def test_missing_and_corrupt_devices_are_errors_not_crashes(root: Path) -> None:
    b = SimBackend(root, {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-gone"})
    assert b.ranks()[1].error is not None
    assert b.read(1).error == "NotFound"
    (root / "GPU-aaaa" / "device.json").write_text("{not json")
    err = b.read(0).error
    assert err is not None and err.startswith("InvalidState")


def test_temp_and_half_written_proc_files_are_ignored(root: Path) -> None:
    procs = root / "GPU-aaaa" / "procs"
    (procs / ".123-x.json.tmp").write_text(json.dumps({"pid": os.getpid(), "bytes": GIB}))
    (procs / f"{os.getpid()}-half.json").write_text('{"pid": 1, "by')
    (procs / f"{os.getpid()}-bool.json").write_text(json.dumps({"pid": os.getpid(), "bytes": True}))
    assert SimBackend(root, {}).read(0).used_bytes == GIB // 2


def test_read_device_and_write_proc_round_trip(root: Path) -> None:
    dev = read_device(root, "GPU-cccc")
    assert (dev.index, dev.comm_init_bytes, dev.lost) == (2, GIB, False)
    path = write_proc(root, "GPU-cccc", "probe", 123)
    assert json.loads(path.read_text()) == {"pid": os.getpid(), "tag": "probe", "bytes": 123}
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_backend_selection(root: Path) -> None:
    assert resolve_backend_kind("auto", {"RANKGUARD_SIM_GPU_ROOT": str(root)}) == "sim"
    assert resolve_backend_kind("auto", {}) == "nvml"
    with pytest.raises(ValueError, match="unknown GPU backend"):
        resolve_backend_kind("rocm", {})
    b = open_backend("auto", {"RANKGUARD_SIM_GPU_ROOT": str(root)})
    assert b.name == "sim" and len(b.ranks()) == 3
    with pytest.raises(GpuUnavailable, match="RANKGUARD_SIM_GPU_ROOT"):
        open_backend("sim", {})
    with pytest.raises(GpuUnavailable, match="not a directory"):
        SimBackend(root / "nowhere", {})


def test_processes_are_one_entry_per_live_process(root: Path) -> None:
    """As NVML lists them: a process's allocations of every tag summed, the dead left out."""
    write_proc(root, "GPU-aaaa", "vllm", 30 * GIB)
    write_proc(root, "GPU-aaaa", "graphs", 2 * GIB)
    write_proc(root, "GPU-aaaa", "ghost", 7 * GIB, pid=dead_pid())
    b = SimBackend(root, {})
    assert [(p.pid, p.used_bytes) for p in b.processes(0) or []] == [(os.getpid(), 32 * GIB)]
    remove_proc(root, "GPU-aaaa", "graphs")
    assert [(p.pid, p.used_bytes) for p in b.processes(0) or []] == [(os.getpid(), 30 * GIB)]


def test_vmm_is_the_device_docs_and_true_when_an_older_doc_lacks_it(root: Path) -> None:
    assert read_device(root, "GPU-aaaa").vmm is True
    assert json.loads((root / "GPU-aaaa" / "device.json").read_text())["vmm"] is True
    assert SimBackend(root, {}).vmm_supported() is True
    write_device(root, "GPU-bbbb", index=1, total_bytes=80 * GIB, vmm=False)
    assert SimBackend(root, {}).vmm_supported() is False
    assert SimBackend(root, {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa"}).vmm_supported() is True
    older = json.loads((root / "GPU-bbbb" / "device.json").read_text())
    del older["vmm"]
    (root / "GPU-bbbb" / "device.json").write_text(json.dumps(older))
    assert read_device(root, "GPU-bbbb").vmm is True
    assert SimBackend(root, {"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb,GPU-gone"}).vmm_supported() is None
