"""The simulated backend: reads the sandbox world's GPUs from disk (docs/sim-world.md).

    $RANKGUARD_SIM_GPU_ROOT/<uuid>/device.json
    $RANKGUARD_SIM_GPU_ROOT/<uuid>/procs/<pid>-<tag>.json

used = reserved_bytes + bytes of the live processes' files; free = max(0, total - used).

The sampler reads every rank ten times a second for as long as the pod lives, so a read
costs two stat() calls and one kill(pid, 0) per process in the common case: device.json is
re-parsed only when its inode, size or mtime moves, and the procs folder is re-listed only
when its mtime moves (writers replace files atomically, which always touches the folder).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankguard_agent.gpu import GpuReading, GpuUnavailable, ProcessMemory, RankDevice, failed_reading
from rankguard_agent.gpu.visible import apply_cuda_visible, split_list

# A timestamp this close to now may hide a second change in the same clock tick.
_SETTLE_NS = 50_000_000


@dataclass(frozen=True, slots=True)
class SimDevice:
    uuid: str
    index: int
    name: str
    total_bytes: int
    reserved_bytes: int
    comm_init_bytes: int
    lost: bool


@dataclass(frozen=True, slots=True)
class SimProc:
    pid: int
    tag: str
    bytes: int


def _int(doc: dict[str, Any], key: str) -> int:
    v = doc.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{key}: expected a non-negative integer, got {v!r:.40}")
    return v


def parse_device(raw: bytes, uuid: str) -> SimDevice:
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("device.json is not an object")
    return SimDevice(
        uuid=str(doc.get("uuid", uuid)),
        index=_int(doc, "index"),
        name=str(doc.get("name", "")),
        total_bytes=_int(doc, "total_bytes"),
        reserved_bytes=_int(doc, "reserved_bytes"),
        comm_init_bytes=_int(doc, "comm_init_bytes"),
        lost=bool(doc.get("lost", False)),
    )


def read_device(root: str | os.PathLike[str], uuid: str) -> SimDevice:
    """One device's state, read fresh (the probe's and the tests' entry point)."""
    return parse_device((Path(root) / uuid / "device.json").read_bytes(), uuid)


def write_device(
    root: str | os.PathLike[str],
    uuid: str,
    *,
    index: int,
    total_bytes: int,
    reserved_bytes: int = 0,
    comm_init_bytes: int = 0,
    lost: bool = False,
    name: str = "NVIDIA H100 80GB HBM3 (simulated)",
) -> Path:
    """Write a device.json the way the sandbox world does (tests and benchmarks build worlds)."""
    folder = Path(root) / uuid
    (folder / "procs").mkdir(parents=True, exist_ok=True)
    doc = {
        "uuid": uuid,
        "index": index,
        "name": name,
        "total_bytes": total_bytes,
        "reserved_bytes": reserved_bytes,
        "comm_init_bytes": comm_init_bytes,
        "lost": lost,
    }
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, folder / "device.json")
    return folder / "device.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OSError:
        return False
    return True


def proc_path(root: str | os.PathLike[str], uuid: str, pid: int, tag: str) -> Path:
    return Path(root) / uuid / "procs" / f"{pid}-{tag}.json"


def write_proc(
    root: str | os.PathLike[str], uuid: str, tag: str, nbytes: int, pid: int | None = None
) -> Path:
    """Hold `nbytes` on a simulated GPU for this process (atomically, as the layout asks)."""
    pid = os.getpid() if pid is None else pid
    path = proc_path(root, uuid, pid, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": pid, "tag": tag, "bytes": int(nbytes)}, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def remove_proc(root: str | os.PathLike[str], uuid: str, tag: str, pid: int | None = None) -> None:
    pid = os.getpid() if pid is None else pid
    with contextlib.suppress(FileNotFoundError):
        proc_path(root, uuid, pid, tag).unlink()


def scan_procs(procs_dir: str) -> list[SimProc]:
    out = []
    try:
        names = os.listdir(procs_dir)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue  # a writer's temp file
        try:
            with open(os.path.join(procs_dir, name), "rb") as f:
                doc = json.loads(f.read())
            pid, nbytes = doc["pid"], doc["bytes"]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, nbytes)):
                out.append(SimProc(pid=pid, tag=str(doc.get("tag", "")), bytes=max(0, nbytes)))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # vanished or half-written: the next read sees the settled state
    return out


class _RankFiles:
    """Cached parse of one device's files, keyed by what stat() says about them."""

    def __init__(self, root: str, uuid: str) -> None:
        self.device_path = os.path.join(root, uuid, "device.json")
        self.procs_dir = os.path.join(root, uuid, "procs")
        self.device_key: tuple[int, int, int] | None = None
        self.device: SimDevice | None = None
        self.procs_key: tuple[int, int] | None = None
        self.procs: list[SimProc] = []

    def load_device(self, uuid: str, now_ns: int) -> SimDevice:
        st = os.stat(self.device_path)
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self.device is None or key != self.device_key or now_ns - st.st_mtime_ns < _SETTLE_NS:
            with open(self.device_path, "rb") as f:
                self.device = parse_device(f.read(), uuid)
            self.device_key = key
        return self.device

    def load_procs(self, now_ns: int) -> list[SimProc]:
        try:
            st = os.stat(self.procs_dir)
        except FileNotFoundError:
            self.procs_key, self.procs = None, []
            return self.procs
        key = (st.st_ino, st.st_mtime_ns)
        if key != self.procs_key or now_ns - st.st_mtime_ns < _SETTLE_NS:
            self.procs = scan_procs(self.procs_dir)
            self.procs_key = key
        return self.procs


def sim_uuids(root: str, env: Mapping[str, str]) -> list[str]:
    """The pod's GPUs: NVIDIA_VISIBLE_DEVICES in its order (the sim contract), else all by index."""
    listed = env.get("NVIDIA_VISIBLE_DEVICES")
    if listed is not None and listed.strip().lower() not in ("", "all", "void", "none"):
        return [u for u in split_list(listed) if u]
    found = []
    for entry in sorted(os.listdir(root)):
        try:
            found.append(read_device(root, entry))
        except (OSError, ValueError):
            continue
    return [d.uuid for d in sorted(found, key=lambda d: d.index)]


class SimBackend:
    name = "sim"

    def __init__(self, root: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> None:
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise GpuUnavailable(f"simulated GPU root {self.root!r} is not a directory")
        env = os.environ if env is None else env
        uuids = sim_uuids(self.root, env)
        sel = apply_cuda_visible(uuids, env.get("CUDA_VISIBLE_DEVICES"))
        self.warnings = [sel.warning] if sel.warning else []
        chosen = [uuids[t.index] if t.index is not None else (t.mig_uuid or "") for t in sel.targets]
        self._devices: list[RankDevice] = []
        for rank, uuid in enumerate(chosen):
            try:
                name = read_device(self.root, uuid).name
                self._devices.append(RankDevice(rank=rank, uuid=uuid, name=name))
            except (OSError, ValueError) as e:
                self._devices.append(RankDevice(rank=rank, uuid=uuid, error=f"NotFound: {e}"[:200]))
        self._files = [_RankFiles(self.root, d.uuid) for d in self._devices]

    def ranks(self) -> list[RankDevice]:
        return list(self._devices)

    def device(self, rank: int) -> SimDevice:
        return read_device(self.root, self._devices[rank].uuid)

    def read(self, rank: int) -> GpuReading:
        uuid = self._devices[rank].uuid
        files = self._files[rank]
        now_ns = time.time_ns()
        try:
            dev = files.load_device(uuid, now_ns)
            procs = files.load_procs(now_ns)
        except FileNotFoundError:
            return failed_reading(rank, uuid, "NotFound")
        except (OSError, ValueError) as e:
            return failed_reading(rank, uuid, f"InvalidState: {e}"[:200])
        if dev.lost:
            return failed_reading(rank, uuid, "GpuIsLost")
        used = dev.reserved_bytes + sum(p.bytes for p in procs if pid_alive(p.pid))
        free = max(0, dev.total_bytes - used)
        return GpuReading(rank, uuid, dev.total_bytes, min(used, dev.total_bytes), free, dev.reserved_bytes)

    def processes(self, rank: int) -> list[ProcessMemory]:
        procs_dir = os.path.join(self.root, self._devices[rank].uuid, "procs")
        return [ProcessMemory(p.pid, p.bytes) for p in scan_procs(procs_dir) if pid_alive(p.pid)]

    def close(self) -> None:
        return None
