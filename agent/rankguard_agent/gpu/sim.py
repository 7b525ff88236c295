"""The simulated backend: reads the sandbox world's GPUs from disk (docs/sim-world.md).

    $RANKGUARD_SIM_GPU_ROOT/<uuid>/device.json
    $RANKGUARD_SIM_GPU_ROOT/<uuid>/procs/<pid>-<tag>.json

used = reserved_bytes + bytes of the live processes' files; free = max(0, total - used).
The files themselves are read and written by `simfiles`, the one codec of that layout (the
sandbox world builds its GPUs on it too).

The sampler reads every rank ten times a second for as long as the pod lives, so a read
costs two stat() calls and one kill(pid, 0) per process in the common case: device.json is
re-parsed only when its inode, size or mtime moves, and the procs folder is re-listed only
when its mtime moves (writers replace files atomically, which always touches the folder).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Mapping

from rankguard_agent.gpu.interface import (
    GpuReading,
    GpuUnavailable,
    ProcessMemory,
    RankDevice,
    failed_reading,
)
from rankguard_agent.gpu.simfiles import (
    SimDevice,
    SimProc,
    parse_device,
    pid_alive,
    proc_path,
    read_device,
    remove_proc,
    scan_procs,
    used_and_free,
    visible_uuids,
    write_proc,
)
from rankguard_agent.gpu.visible import apply_cuda_visible

# The allocation tag of a communicator held by `communicator_init` (the probe's ranks).
COMM_TAG = "probe"
# A timestamp this close to now may hide a second change in the same clock tick.
_SETTLE_NS = 50_000_000


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
    listed = visible_uuids(env)
    if listed is not None:
        return listed
    found = []
    for entry in sorted(os.listdir(root)):
        try:
            found.append(read_device(root, entry))
        except (OSError, ValueError):
            continue
    return [d.uuid for d in sorted(found, key=lambda d: d.index)]


def release_communicators(root: str, pids: Iterable[int]) -> None:
    """Remove what `communicator_init` of these (killed) processes still holds on any GPU.

    A dead pid's file already counts for nothing; this only tidies the world up.
    """
    if not os.path.isdir(root):
        return
    pids = list(pids)
    for uuid in os.listdir(root):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.unlink(proc_path(root, uuid, pid, COMM_TAG))


class SimBackend:
    name = "sim"
    simulated = True

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
        used, free = used_and_free(dev, procs)
        return GpuReading(rank, uuid, dev.total_bytes, used, free, dev.reserved_bytes)

    def processes(self, rank: int) -> list[ProcessMemory] | None:
        """The live processes' memory, one entry per process as NVML lists them (a process's
        files of all tags summed). Read through the same cache as `read`: the sampler asks
        for it every tick."""
        try:
            procs = self._files[rank].load_procs(time.time_ns())
        except OSError:
            return None
        held: dict[int, int] = {}
        for p in procs:
            if pid_alive(p.pid):
                held[p.pid] = held.get(p.pid, 0) + p.bytes
        return [ProcessMemory(pid, nbytes) for pid, nbytes in held.items()]

    def vmm_supported(self) -> bool | None:
        """Whether every rank's simulated driver has virtual memory management (the device
        doc's `vmm`); None when the pod has no GPU or one cannot be read."""
        if not self._devices:
            return None
        try:
            return all(self.device(rank).vmm for rank in range(len(self._devices)))
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def communicator_init(self, rank: int) -> Iterator[None]:
        """Pay the device's `comm_init_bytes` (the world's cost of a CUDA context + NCCL
        communicator) with an allocation file for as long as the block runs, as NCCL would
        hold device memory; when it does not fit, fail the way CUDA does."""
        dev = self.device(rank)
        reading = self.read(rank)
        if reading.error is not None:
            raise RuntimeError(f"reading rank {rank}'s GPU failed: {reading.error}")
        if dev.comm_init_bytes > reading.free_bytes:
            raise RuntimeError(
                f"CUDA out of memory during communicator init on rank {rank}: needs "
                f"{dev.comm_init_bytes} bytes, {reading.free_bytes} free"
            )
        write_proc(self.root, dev.uuid, COMM_TAG, dev.comm_init_bytes)
        try:
            yield
        finally:
            remove_proc(self.root, dev.uuid, COMM_TAG)

    def close(self) -> None:
        return None
