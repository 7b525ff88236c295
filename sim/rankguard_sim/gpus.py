"""The simulated GPUs: the WRITER side of docs/sim-world.md.

A node's GPUs are folders under one root; every process that "uses" a GPU keeps one small
JSON file per allocation tag under `<uuid>/procs/`. The world (process kubelet) creates the
devices, the fake vLLM and the agent's probe hold allocations, and any reader (the agent's
`sim` backend, the tests) sums the files of live processes:

    used = reserved_bytes + Σ bytes of live procs        free = max(0, total − used)

Every write is atomic (temp file in the same folder, then `os.replace`), so a reader that
polls ten times a second never sees a half-written file. Temp files start with "." and end
in ".tmp" so that readers, which only read `*.json`, skip them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

GPU_ROOT_ENV = "RANKGUARD_SIM_GPU_ROOT"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
DEFAULT_SEED = "rankguard-sim"
DEFAULT_NAME = "NVIDIA H100 80GB HBM3 (simulated)"

# Tags become part of a file name: keep them to a safe, readable alphabet.
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

PathLike = str | os.PathLike[str]


class SimGpuError(RuntimeError):
    """The simulated GPU state is missing or malformed."""


@dataclass(frozen=True)
class Device:
    uuid: str
    index: int
    name: str
    total_bytes: int
    reserved_bytes: int = 0
    comm_init_bytes: int = 0
    lost: bool = False

    def to_doc(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "reserved_bytes": self.reserved_bytes,
            "comm_init_bytes": self.comm_init_bytes,
            "lost": self.lost,
        }


@dataclass(frozen=True)
class ProcAllocation:
    pid: int
    tag: str
    bytes: int


@dataclass(frozen=True)
class MemoryReading:
    """What NVML's nvmlDeviceGetMemoryInfo would answer for one simulated GPU."""

    total_bytes: int
    used_bytes: int
    free_bytes: int


# ---------------------------------------------------------------------------------------------
# Small file helpers


def _atomic_write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _non_negative_int(doc: Mapping[str, Any], key: str, where: Path) -> int:
    value = doc.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SimGpuError(f"{where}: {key} must be a non-negative integer, got {value!r:.40}")
    return value


def _check_bytes(nbytes: int, what: str) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{what} must be a non-negative integer number of bytes, got {nbytes!r:.40}")
    return nbytes


def pid_alive(pid: int) -> bool:
    """The contract's liveness test: a pid that `kill(pid, 0)` cannot find is dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, just someone else's
    return True


# ---------------------------------------------------------------------------------------------
# Devices (the world's side)


def gpu_uuid(seed: str, index: int) -> str:
    """A deterministic NVIDIA-style UUID ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx").

    Deterministic so that tests and the demo name the same GPUs on every run, and distinct
    per seed so that two simulated nodes never share a GPU.
    """
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_path(root: PathLike, uuid: str) -> Path:
    return Path(root) / uuid / "device.json"


def procs_dir(root: PathLike, uuid: str) -> Path:
    return Path(root) / uuid / "procs"


def write_device(root: PathLike, device: Device) -> Path:
    path = device_path(root, device.uuid)
    procs_dir(root, device.uuid).mkdir(parents=True, exist_ok=True)
    _atomic_write_json(path, device.to_doc())
    return path


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
) -> list[str]:
    """Create (or reset) `count` GPUs under `root` and return their UUIDs in index order.

    Existing allocations of the same UUIDs are kept: re-registering a node must not make
    a running process's memory vanish.
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
            ),
        )
        uuids.append(uuid)
    return uuids


def read_device(root: PathLike, uuid: str) -> Device:
    path = device_path(root, uuid)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise SimGpuError(f"no simulated GPU {uuid!r} under {root}") from None
    except ValueError as e:
        raise SimGpuError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SimGpuError(f"{path}: expected an object")
    return Device(
        uuid=str(doc.get("uuid", uuid)),
        index=_non_negative_int(doc, "index", path),
        name=str(doc.get("name", "")),
        total_bytes=_non_negative_int(doc, "total_bytes", path),
        reserved_bytes=_non_negative_int(doc, "reserved_bytes", path),
        comm_init_bytes=_non_negative_int(doc, "comm_init_bytes", path),
        lost=bool(doc.get("lost", False)),
    )


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
    current = read_device(root, uuid)
    doc = current.to_doc()
    doc.update(changes)
    updated = Device(**doc)
    write_device(root, updated)
    return updated


def set_comm_init_bytes(root: PathLike, uuid: str, nbytes: int) -> Device:
    """What a CUDA context plus an NCCL communicator cost on this GPU (the probe pays it)."""
    return _update_device(root, uuid, comm_init_bytes=_check_bytes(nbytes, "comm_init_bytes"))


def set_reserved_bytes(root: PathLike, uuid: str, nbytes: int) -> Device:
    return _update_device(root, uuid, reserved_bytes=_check_bytes(nbytes, "reserved_bytes"))


def mark_lost(root: PathLike, uuid: str, lost: bool = True) -> Device:
    """Make the GPU answer like NVML's GpuIsLost (or bring it back with lost=False)."""
    return _update_device(root, uuid, lost=bool(lost))


def remove_gpu(root: PathLike, uuid: str) -> None:
    """Forget a GPU and every allocation on it (a node being torn down)."""
    shutil.rmtree(Path(root) / uuid, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Readings (any side)


def _read_proc_file(path: Path) -> ProcAllocation | None:
    try:
        doc = json.loads(path.read_bytes())
        pid, nbytes = doc["pid"], doc["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # vanished or not ours: the next read sees the settled state
    if isinstance(pid, bool) or not isinstance(pid, int):
        return None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        return None
    return ProcAllocation(pid=pid, tag=str(doc.get("tag", "")), bytes=max(0, nbytes))


def _proc_files(root: PathLike, uuid: str) -> list[Path]:
    folder = procs_dir(root, uuid)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return [folder / n for n in sorted(names) if n.endswith(".json") and not n.startswith(".")]


def all_allocations(root: PathLike, uuid: str) -> list[ProcAllocation]:
    """Every allocation file on the GPU, live or not."""
    out = []
    for path in _proc_files(root, uuid):
        proc = _read_proc_file(path)
        if proc is not None:
            out.append(proc)
    return out


def live_allocations(root: PathLike, uuid: str) -> list[ProcAllocation]:
    return [p for p in all_allocations(root, uuid) if pid_alive(p.pid)]


def memory(root: PathLike, uuid: str) -> MemoryReading:
    device = read_device(root, uuid)
    used = device.reserved_bytes + sum(p.bytes for p in live_allocations(root, uuid))
    used = min(used, device.total_bytes)
    return MemoryReading(
        total_bytes=device.total_bytes, used_bytes=used, free_bytes=device.total_bytes - used
    )


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
        for path in _proc_files(root, entry.name):
            proc = _read_proc_file(path)
            if proc is not None and pid_alive(proc.pid):
                continue
            if proc is None and path.exists():
                continue  # unreadable but present: maybe mid-replace, leave it
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def visible_uuids(env: Mapping[str, str] | None = None) -> list[str]:
    """The pod's GPUs in rank order, as the process kubelet passes them (NVIDIA_VISIBLE_DEVICES)."""
    env = os.environ if env is None else env
    raw = env.get(VISIBLE_DEVICES_ENV, "")
    if raw.strip().lower() in ("", "all", "none", "void"):
        return []
    return [u.strip() for u in raw.split(",") if u.strip()]


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
        return procs_dir(self.root, self.uuid) / f"{self.pid}-{self.tag}.json"

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def active(self) -> bool:
        return self._written

    def set(self, nbytes: int) -> int:
        """Hold exactly `nbytes` (no capacity check: the caller decides what fits)."""
        _check_bytes(nbytes, "allocation size")
        _atomic_write_json(self.path, {"pid": self.pid, "tag": self.tag, "bytes": nbytes})
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
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
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
