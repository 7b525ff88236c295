"""The simulated GPUs: the world's side of docs/sim-world.md.

A node's GPUs are folders under one root; every process that "uses" a GPU keeps one small
JSON file per allocation tag under `<uuid>/procs/`. The world (process kubelet) creates the
devices, the fake vLLM and the agent's probe hold allocations, and any reader (the agent's
`sim` backend, the tests) sums the files of live processes:

    used = reserved_bytes + Σ bytes of live procs        free = max(0, total − used)

The files themselves are read and written by `rankguard_agent.gpu.simfiles`, the contract's
only implementation (the agent must never import this package, so it lives there); this
module adds what only the world does: naming and creating devices, changing their facts,
cleaning up after dead processes, and the `Allocation` a simulated process holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rankguard_agent.gpu import simfiles
from rankguard_agent.gpu.simfiles import (
    DEFAULT_NAME,
    SIM_ROOT_ENV,
    PathLike,
    device_path,
    pid_alive,
    procs_dir,
)

GPU_ROOT_ENV = SIM_ROOT_ENV
# Where a pod's IMEX channels are (the files vLLM opens for FABRIC handles): the process kubelet
# points each pod at its own folder, with a channel or without; the fake vLLM and the agent glob it.
IMEX_CHANNELS_GLOB_ENV = "RANKGUARD_IMEX_CHANNELS_GLOB"
DEFAULT_SEED = "rankguard-sim"

# Tags become part of a file name: keep them to a safe, readable alphabet.
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# The contract's records under the names the world has always used.
Device = simfiles.SimDevice
ProcAllocation = simfiles.SimProc


class SimGpuError(RuntimeError):
    """The simulated GPU state is missing or malformed."""


@dataclass(frozen=True)
class MemoryReading:
    """What NVML's nvmlDeviceGetMemoryInfo would answer for one simulated GPU."""

    total_bytes: int
    used_bytes: int
    free_bytes: int


def _check_bytes(nbytes: int, what: str) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{what} must be a non-negative integer number of bytes, got {nbytes!r:.40}")
    return nbytes


# ---------------------------------------------------------------------------------------------
# Devices (the world's side)


def gpu_uuid(seed: str, index: int) -> str:
    """A deterministic NVIDIA-style UUID ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx").

    Deterministic so that tests and the demo name the same GPUs on every run, and distinct
    per seed so that two simulated nodes never share a GPU.
    """
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def write_device(root: PathLike, device: Device) -> Path:
    return simfiles.store_device(root, device)


def create_gpus(
    root: PathLike,
    count: int,
    total_bytes: int,
    *,
    seed: str = DEFAULT_SEED,
    name: str = DEFAULT_NAME,
    reserved_bytes: int = 0,
    comm_init_bytes: int = 0,
    start_index: int = 0,
    vmm: bool = True,
) -> list[str]:
    """Create (or reset) `count` GPUs under `root` and return their UUIDs in index order.

    Existing allocations of the same UUIDs are kept: re-registering a node must not make
    a running process's memory vanish. `vmm=False`: a driver without virtual memory management
    (vLLM 0.34's extensible KV cache falls back to estimate-based sizing there).
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    _check_bytes(total_bytes, "total_bytes")
    _check_bytes(reserved_bytes, "reserved_bytes")
    _check_bytes(comm_init_bytes, "comm_init_bytes")
    if reserved_bytes > total_bytes:
        raise ValueError("reserved_bytes cannot exceed total_bytes")
    Path(root).mkdir(parents=True, exist_ok=True)
    uuids = []
    for i in range(count):
        index = start_index + i
        uuid = gpu_uuid(seed, index)
        write_device(
            root,
            Device(
                uuid=uuid,
                index=index,
                name=name,
                total_bytes=total_bytes,
                reserved_bytes=reserved_bytes,
                comm_init_bytes=comm_init_bytes,
                vmm=vmm,
            ),
        )
        uuids.append(uuid)
    return uuids


def read_device(root: PathLike, uuid: str) -> Device:
    try:
        return simfiles.read_device(root, uuid)
    except FileNotFoundError:
        raise SimGpuError(f"no simulated GPU {uuid!r} under {root}") from None
    except (OSError, ValueError) as e:
        raise SimGpuError(f"{device_path(root, uuid)}: {e}") from None


def list_gpus(root: PathLike) -> list[Device]:
    """Every GPU under `root`, by index."""
    found = []
    base = Path(root)
    if not base.is_dir():
        return []
    for entry in sorted(base.iterdir()):
        if (entry / "device.json").is_file():
            found.append(read_device(root, entry.name))
    return sorted(found, key=lambda d: (d.index, d.uuid))


def _update_device(root: PathLike, uuid: str, **changes: Any) -> Device:
    updated = dataclasses.replace(read_device(root, uuid), **changes)
    write_device(root, updated)
    return updated


def set_comm_init_bytes(root: PathLike, uuid: str, nbytes: int) -> Device:
    """What a CUDA context plus an NCCL communicator cost on this GPU (the probe pays it)."""
    return _update_device(root, uuid, comm_init_bytes=_check_bytes(nbytes, "comm_init_bytes"))


def set_reserved_bytes(root: PathLike, uuid: str, nbytes: int) -> Device:
    return _update_device(root, uuid, reserved_bytes=_check_bytes(nbytes, "reserved_bytes"))


def set_vmm(root: PathLike, uuid: str, vmm: bool) -> Device:
    """Whether the GPU's driver supports virtual memory management (device.json's `vmm`)."""
    return _update_device(root, uuid, vmm=bool(vmm))


def mark_lost(root: PathLike, uuid: str, lost: bool = True) -> Device:
    """Make the GPU answer like NVML's GpuIsLost (or bring it back with lost=False)."""
    return _update_device(root, uuid, lost=bool(lost))


def remove_gpu(root: PathLike, uuid: str) -> None:
    """Forget a GPU and every allocation on it (a node being torn down)."""
    shutil.rmtree(Path(root) / uuid, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Readings (any side)


def all_allocations(root: PathLike, uuid: str) -> list[ProcAllocation]:
    """Every allocation file on the GPU, live or not."""
    return simfiles.scan_procs(procs_dir(root, uuid))


def live_allocations(root: PathLike, uuid: str) -> list[ProcAllocation]:
    return [p for p in all_allocations(root, uuid) if pid_alive(p.pid)]


def memory(root: PathLike, uuid: str) -> MemoryReading:
    device = read_device(root, uuid)
    used, free = simfiles.used_and_free(device, all_allocations(root, uuid))
    return MemoryReading(total_bytes=device.total_bytes, used_bytes=used, free_bytes=free)


def used_bytes(root: PathLike, uuid: str) -> int:
    return memory(root, uuid).used_bytes


def free_bytes(root: PathLike, uuid: str) -> int:
    return memory(root, uuid).free_bytes


def process_bytes(root: PathLike, uuid: str, pid: int) -> int:
    """What one process holds on the GPU (NVML's per-process usedGpuMemory)."""
    return sum(p.bytes for p in live_allocations(root, uuid) if p.pid == pid)


def cleanup_dead(root: PathLike) -> int:
    """Remove the allocation files of dead processes on every GPU; returns how many went."""
    removed = 0
    base = Path(root)
    if not base.is_dir():
        return 0
    for entry in sorted(base.iterdir()):
        for path in simfiles.proc_files(procs_dir(root, entry.name)):
            proc = simfiles.read_proc_file(path)
            if proc is not None and pid_alive(proc.pid):
                continue
            if proc is None and os.path.exists(path):
                continue  # unreadable but present: maybe mid-replace, leave it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    return removed


def visible_uuids(env: Mapping[str, str] | None = None) -> list[str]:
    """The pod's GPUs in rank order, as the process kubelet passes them (NVIDIA_VISIBLE_DEVICES)."""
    return simfiles.visible_uuids(os.environ if env is None else env) or []


# ---------------------------------------------------------------------------------------------
# Allocations (a process's side)


def check_tag(tag: str) -> str:
    if not _TAG_RE.match(tag):
        raise ValueError(f"allocation tag {tag!r} must match {_TAG_RE.pattern}")
    return tag


class Allocation:
    """One process's memory on one simulated GPU, under one tag.

    The file exists from the first `set`/`add` until `release`, even at zero bytes, so a
    reader can tell "holds nothing right now" from "never started". One owner, one thread.
    """

    def __init__(self, root: PathLike, uuid: str, tag: str, pid: int | None = None) -> None:
        self.root = Path(root)
        self.uuid = uuid
        self.tag = check_tag(tag)
        self.pid = os.getpid() if pid is None else pid
        self._bytes = 0
        self._written = False
        if not device_path(root, uuid).is_file():
            raise SimGpuError(f"no simulated GPU {uuid!r} under {root}")

    @property
    def path(self) -> Path:
        return simfiles.proc_path(self.root, self.uuid, self.pid, self.tag)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def active(self) -> bool:
        return self._written

    def set(self, nbytes: int) -> int:
        """Hold exactly `nbytes` (no capacity check: the caller decides what fits)."""
        _check_bytes(nbytes, "allocation size")
        simfiles.write_proc(self.root, self.uuid, self.tag, nbytes, pid=self.pid)
        self._bytes = nbytes
        self._written = True
        return nbytes

    def add(self, nbytes: int) -> int:
        """Grow (or, with a negative delta, shrink) the allocation; returns the new size."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise ValueError(f"allocation delta must be an integer, got {nbytes!r:.40}")
        if self._bytes + nbytes < 0:
            raise ValueError(f"cannot release {-nbytes} bytes from an allocation of {self._bytes}")
        return self.set(self._bytes + nbytes)

    def release(self) -> None:
        """Give everything back and remove the file. Safe to call twice."""
        simfiles.remove_proc(self.root, self.uuid, self.tag, pid=self.pid)
        self._bytes = 0
        self._written = False

    def __enter__(self) -> Allocation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Allocation(uuid={self.uuid!r}, tag={self.tag!r}, pid={self.pid}, bytes={self._bytes})"
