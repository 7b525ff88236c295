"""The simulated GPUs on disk: the writer side of docs/sim-world.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rankguard_sim.physics import gpus

GIB = 1 << 30
UUID_RE = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def dead_pid() -> int:
    """A pid that existed and is gone (reaped), so kill(pid, 0) raises ProcessLookupError."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_uuids_are_deterministic_nvidia_style_and_distinct_per_seed(tmp_path: Path) -> None:
    a = gpus.create_gpus(tmp_path / "a", 4, 80 * GIB, seed="node-1")
    again = gpus.create_gpus(tmp_path / "b", 4, 80 * GIB, seed="node-1")
    other = gpus.create_gpus(tmp_path / "c", 4, 80 * GIB, seed="node-2")
    assert a == again
    assert not set(a) & set(other)
    assert len(set(a)) == 4
    assert all(UUID_RE.match(u) for u in a)


def test_device_json_carries_the_contract_fields(tmp_path: Path) -> None:
    uuids = gpus.create_gpus(tmp_path, 2, 80 * GIB, seed="s", name="NVIDIA X (simulated)", reserved_bytes=5)
    doc = json.loads((tmp_path / uuids[1] / "device.json").read_text())
    assert doc == {
        "uuid": uuids[1],
        "index": 1,
        "name": "NVIDIA X (simulated)",
        "total_bytes": 80 * GIB,
        "reserved_bytes": 5,
        "comm_init_bytes": 0,
        "lost": False,
        "vmm": True,
    }
    assert (tmp_path / uuids[1] / "procs").is_dir()
    without = gpus.create_gpus(tmp_path / "old-driver", 1, 80 * GIB, seed="s", vmm=False)
    assert json.loads((tmp_path / "old-driver" / without[0] / "device.json").read_text())["vmm"] is False
    assert gpus.set_vmm(tmp_path / "old-driver", without[0], True).vmm
    assert [d.uuid for d in gpus.list_gpus(tmp_path)] == uuids


def test_start_index_numbers_a_second_batch_after_the_first(tmp_path: Path) -> None:
    first = gpus.create_gpus(tmp_path, 2, GIB * 2, seed="n")
    more = gpus.create_gpus(tmp_path, 2, GIB * 2, seed="n", start_index=2)
    assert [d.index for d in gpus.list_gpus(tmp_path)] == [0, 1, 2, 3]
    assert [d.uuid for d in gpus.list_gpus(tmp_path)] == first + more


def test_allocation_set_add_release_moves_used_and_free(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB, reserved_bytes=GIB)
    assert gpus.memory(tmp_path, uuid) == gpus.MemoryReading(10 * GIB, GIB, 9 * GIB)
    alloc = gpus.Allocation(tmp_path, uuid, "vllm")
    alloc.set(2 * GIB)
    assert alloc.add(GIB) == 3 * GIB
    assert gpus.used_bytes(tmp_path, uuid) == 4 * GIB
    assert gpus.free_bytes(tmp_path, uuid) == 6 * GIB
    assert gpus.process_bytes(tmp_path, uuid, os.getpid()) == 3 * GIB
    path = tmp_path / uuid / "procs" / f"{os.getpid()}-vllm.json"
    assert json.loads(path.read_text()) == {"pid": os.getpid(), "tag": "vllm", "bytes": 3 * GIB}
    alloc.add(-GIB)
    assert gpus.used_bytes(tmp_path, uuid) == 3 * GIB
    alloc.release()
    assert not path.exists()
    assert gpus.free_bytes(tmp_path, uuid) == 9 * GIB
    alloc.release()  # twice is harmless
    assert list((tmp_path / uuid / "procs").iterdir()) == []  # and no temp files are left behind


def test_two_tags_of_one_process_add_up_and_release_separately(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB)
    with gpus.Allocation(tmp_path, uuid, "probe") as probe:
        probe.set(GIB)
        vllm = gpus.Allocation(tmp_path, uuid, "vllm")
        vllm.set(2 * GIB)
        assert gpus.used_bytes(tmp_path, uuid) == 3 * GIB
    assert gpus.used_bytes(tmp_path, uuid) == 2 * GIB
    vllm.release()


def test_bad_sizes_and_tags_are_refused(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB)
    alloc = gpus.Allocation(tmp_path, uuid, "vllm")
    with pytest.raises(ValueError):
        alloc.set(-1)
    alloc.set(5)
    with pytest.raises(ValueError):
        alloc.add(-6)
    assert alloc.bytes == 5
    for bad in ("", "../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(ValueError):
            gpus.Allocation(tmp_path, uuid, bad)
    with pytest.raises(gpus.SimGpuError):
        gpus.Allocation(tmp_path, "GPU-missing", "vllm")
    alloc.release()


def test_dead_processes_count_for_nothing_and_cleanup_removes_only_them(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB)
    ghost = gpus.Allocation(tmp_path, uuid, "vllm", pid=dead_pid())
    ghost.set(4 * GIB)
    live = gpus.Allocation(tmp_path, uuid, "vllm")
    live.set(GIB)
    assert len(gpus.all_allocations(tmp_path, uuid)) == 2
    assert gpus.used_bytes(tmp_path, uuid) == GIB
    assert gpus.cleanup_dead(tmp_path) == 1
    assert [p.pid for p in gpus.all_allocations(tmp_path, uuid)] == [os.getpid()]
    live.release()


def test_garbage_files_are_skipped_by_readers(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB)
    procs = tmp_path / uuid / "procs"
    (procs / "123-half.json").write_text('{"pid": 1')
    (procs / ".tmp-in-flight.tmp").write_text("{}")
    (procs / f"{os.getpid()}-odd.json").write_text(json.dumps({"pid": os.getpid(), "bytes": "many"}))
    assert gpus.used_bytes(tmp_path, uuid) == 0


def test_world_controls_comm_cost_reserved_and_lost(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB)
    gpus.set_comm_init_bytes(tmp_path, uuid, 3 * GIB)
    gpus.set_reserved_bytes(tmp_path, uuid, GIB)
    gpus.mark_lost(tmp_path, uuid)
    device = gpus.read_device(tmp_path, uuid)
    assert (device.comm_init_bytes, device.reserved_bytes, device.lost) == (3 * GIB, GIB, True)
    assert gpus.mark_lost(tmp_path, uuid, lost=False).lost is False
    with pytest.raises(ValueError):
        gpus.set_comm_init_bytes(tmp_path, uuid, -1)
    gpus.remove_gpu(tmp_path, uuid)
    with pytest.raises(gpus.SimGpuError):
        gpus.read_device(tmp_path, uuid)


def test_recreating_a_node_keeps_running_allocations(tmp_path: Path) -> None:
    (uuid,) = gpus.create_gpus(tmp_path, 1, 10 * GIB, seed="n")
    alloc = gpus.Allocation(tmp_path, uuid, "vllm")
    alloc.set(GIB)
    gpus.create_gpus(tmp_path, 1, 10 * GIB, seed="n")
    assert gpus.used_bytes(tmp_path, uuid) == GIB
    alloc.release()


def test_visible_uuids_follow_nvidia_visible_devices_order() -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-b, GPU-a,,GPU-c"}
    assert gpus.visible_uuids(env) == ["GPU-b", "GPU-a", "GPU-c"]
    assert gpus.visible_uuids({"NVIDIA_VISIBLE_DEVICES": "all"}) == []
    assert gpus.visible_uuids({}) == []


def test_the_agents_reader_sees_what_the_world_writes(tmp_path: Path) -> None:
    """The contract end to end: the agent's sim backend reads these files, not this code."""
    from rankguard_agent.gpu.sim import SimBackend

    uuids = gpus.create_gpus(tmp_path, 2, 10 * GIB, reserved_bytes=GIB)
    alloc = gpus.Allocation(tmp_path, uuids[1], "vllm")
    alloc.set(3 * GIB)
    gpus.Allocation(tmp_path, uuids[1], "ghost", pid=dead_pid()).set(5 * GIB)
    backend = SimBackend(tmp_path, {"NVIDIA_VISIBLE_DEVICES": f"{uuids[1]},{uuids[0]}"})
    rank0 = backend.read(0)
    assert (rank0.uuid, rank0.used_bytes, rank0.free_bytes) == (uuids[1], 4 * GIB, 6 * GIB)
    gpus.mark_lost(tmp_path, uuids[0])
    assert backend.read(1).error == "GpuIsLost"
    alloc.release()
