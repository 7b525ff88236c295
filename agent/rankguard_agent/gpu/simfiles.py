"""The simulated GPUs' files (docs/sim-world.md): the one reader and writer of that layout.

    <root>/<uuid>/device.json              the device, written by the sandbox world
    <root>/<uuid>/procs/<pid>-<tag>.json   one allocation of one process

It lives on the agent's side because the agent must never import `rankguard_sim`; the
sandbox world (`rankguard_sim.physics.gpus`) builds its devices and allocations on these functions,
so the two sides cannot drift apart. Standard library only: the agent runs in a vLLM image.

Every write is atomic (a temp file in the same folder, then `os.replace`): a reader that
polls ten times a second never sees half a file. Temp files start with "." and end in
".tmp", so readers, which only read `*.json` not starting with ".", skip them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where the simulated GPUs live (the world sets it for the pods it runs).
SIM_ROOT_ENV = "RANKGUARD_SIM_GPU_ROOT"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
DEFAULT_NAME = "NVIDIA H100 80GB HBM3 (simulated)"
# NVIDIA_VISIBLE_DEVICES values that name no particular device.
_NO_SPECIFIC_DEVICES = ("", "all", "void", "none")

PathLike = str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class SimDevice:
    """One device.json."""

    uuid: str
    index: int
    name: str
    total_bytes: int
    reserved_bytes: int = 0
    comm_init_bytes: int = 0
    lost: bool = False
    # The driver supports GPU virtual memory management (CUDA's cuMem* API), which vLLM 0.34's
    # extensible KV cache needs; absent from older device docs, which meant a VMM-capable GPU.
    vmm: bool = True

    def to_doc(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "reserved_bytes": self.reserved_bytes,
            "comm_init_bytes": self.comm_init_bytes,
            "lost": self.lost,
            "vmm": self.vmm,
        }


@dataclass(frozen=True, slots=True)
class SimProc:
    """One procs/<pid>-<tag>.json: what one process holds on the GPU under one tag."""

    pid: int
    tag: str
    bytes: int


def device_path(root: PathLike, uuid: str) -> Path:
    return Path(root) / uuid / "device.json"


def procs_dir(root: PathLike, uuid: str) -> Path:
    return Path(root) / uuid / "procs"


def proc_path(root: PathLike, uuid: str, pid: int, tag: str) -> Path:
    return procs_dir(root, uuid) / f"{pid}-{tag}.json"


def atomic_write_json(path: Path, doc: Mapping[str, Any]) -> None:
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


def pid_alive(pid: int) -> bool:
    """The contract's liveness test: a pid that `kill(pid, 0)` cannot find is dead."""
    if pid <= 0:
        return False  # kill(0 or -n, 0) asks about process groups, not about this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, just someone else's
    except OSError:
        return False
    return True


# -- devices ------------------------------------------------------------------------------


def _non_negative_int(doc: Mapping[str, Any], key: str) -> int:
    value = doc.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r:.40}")
    return value


def parse_device(raw: bytes, uuid: str) -> SimDevice:
    """A device.json's content; ValueError when it is not one."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError("expected an object")
    return SimDevice(
        uuid=str(doc.get("uuid", uuid)),
        index=_non_negative_int(doc, "index"),
        name=str(doc.get("name", "")),
        total_bytes=_non_negative_int(doc, "total_bytes"),
        reserved_bytes=_non_negative_int(doc, "reserved_bytes"),
        comm_init_bytes=_non_negative_int(doc, "comm_init_bytes"),
        lost=bool(doc.get("lost", False)),
        vmm=bool(doc.get("vmm", True)),
    )


def read_device(root: PathLike, uuid: str) -> SimDevice:
    """One device's state, read fresh. OSError (FileNotFoundError: no such GPU) or ValueError."""
    return parse_device(device_path(root, uuid).read_bytes(), uuid)


def store_device(root: PathLike, device: SimDevice) -> Path:
    """Write the device's device.json (and its procs folder), as the sandbox world does."""
    procs_dir(root, device.uuid).mkdir(parents=True, exist_ok=True)
    path = device_path(root, device.uuid)
    atomic_write_json(path, device.to_doc())
    return path


def write_device(
    root: PathLike,
    uuid: str,
    *,
    index: int,
    total_bytes: int,
    reserved_bytes: int = 0,
    comm_init_bytes: int = 0,
    lost: bool = False,
    name: str = DEFAULT_NAME,
    vmm: bool = True,
) -> Path:
    """`store_device` by fields (tests and benchmarks build worlds with it)."""
    device = SimDevice(uuid, index, name, total_bytes, reserved_bytes, comm_init_bytes, lost, vmm)
    return store_device(root, device)


# -- allocations --------------------------------------------------------------------------


def write_proc(root: PathLike, uuid: str, tag: str, nbytes: int, pid: int | None = None) -> Path:
    """Hold `nbytes` on a simulated GPU for process `pid` (this one by default) under `tag`."""
    pid = os.getpid() if pid is None else pid
    path = proc_path(root, uuid, pid, tag)
    atomic_write_json(path, {"pid": pid, "tag": tag, "bytes": int(nbytes)})
    return path


def remove_proc(root: PathLike, uuid: str, tag: str, pid: int | None = None) -> None:
    """Give the allocation back. Safe when it is gone already."""
    pid = os.getpid() if pid is None else pid
    with contextlib.suppress(FileNotFoundError):
        proc_path(root, uuid, pid, tag).unlink()


def proc_files(folder: PathLike) -> list[str]:
    """Paths of the allocation files in a procs folder, sorted; writers' temp files skipped."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if n.endswith(".json") and not n.startswith(".")]


def read_proc_file(path: PathLike) -> SimProc | None:
    """One allocation file; None when it vanished or is not (yet) a valid one."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        pid, nbytes = doc["pid"], doc["bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # vanished or half-written: the next read sees the settled state
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, nbytes)):
        return None
    return SimProc(pid=pid, tag=str(doc.get("tag", "")), bytes=max(0, nbytes))


def scan_procs(folder: PathLike) -> list[SimProc]:
    """Every valid allocation file in a procs folder, live or not."""
    return [p for p in map(read_proc_file, proc_files(folder)) if p is not None]


# -- readings -----------------------------------------------------------------------------


def used_and_free(device: SimDevice, procs: Iterable[SimProc]) -> tuple[int, int]:
    """The contract's reading: used = reserved + Σ live procs (at most total); free = total − used."""
    used = device.reserved_bytes + sum(p.bytes for p in procs if pid_alive(p.pid))
    used = min(used, device.total_bytes)
    return used, device.total_bytes - used


def visible_uuids(env: Mapping[str, str]) -> list[str] | None:
    """The pod's GPUs in rank order from NVIDIA_VISIBLE_DEVICES; None when it names no specific one."""
    raw = env.get(VISIBLE_DEVICES_ENV)
    if raw is None or raw.strip().lower() in _NO_SPECIFIC_DEVICES:
        return None
    return [u.strip() for u in raw.split(",") if u.strip()]
