"""The fake vLLM's GPUs: the pod's simulated GPU files as the engine's `Ledger`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from rankguard_sim.physics import gpus

ALLOCATION_TAG = "vllm"
OTHER_TAG = "cuda-context"

# A stand-in process for another process of the container (the API server holding a CUDA
# context on cuda:0): it lives until its stdin closes, so it dies with the fake even after
# SIGKILL, and readers then ignore its allocation file (a dead pid).
_HELPER = [sys.executable, "-S", "-c", "import sys; sys.stdin.buffer.read()"]


class FileLedger:
    """The engine's view of its simulated GPUs: one allocation file per GPU for this process."""

    def __init__(self, root: str, uuids: Sequence[str], pid: int | None = None) -> None:
        self.root = root
        self.uuids = list(uuids)
        self.pid = os.getpid() if pid is None else pid
        self.allocations = [gpus.Allocation(root, u, ALLOCATION_TAG, pid=self.pid) for u in self.uuids]
        self.tags: list[dict[str, int]] = [{} for _ in self.uuids]
        self.helpers: dict[str, subprocess.Popen[bytes]] = {}
        self.other_allocations: list[gpus.Allocation] = []

    def total(self, rank: int) -> int:
        return gpus.read_device(self.root, self.uuids[rank]).total_bytes

    def free(self, rank: int) -> int:
        return gpus.free_bytes(self.root, self.uuids[rank])

    def held(self, rank: int, tag: str) -> int:
        return self.tags[rank].get(tag, 0)

    def hold(self, rank: int, tag: str, nbytes: int) -> None:
        if nbytes:
            self.tags[rank][tag] = nbytes
        else:
            self.tags[rank].pop(tag, None)
        self.allocations[rank].set(sum(self.tags[rank].values()))

    def others(self, rank: int) -> list[tuple[int, int]]:
        per_pid: dict[int, int] = {}
        for proc in gpus.live_allocations(self.root, self.uuids[rank]):
            if proc.pid != self.pid:
                per_pid[proc.pid] = per_pid.get(proc.pid, 0) + proc.bytes
        return sorted(per_pid.items())

    def start_other(self, rank: int, name: str, nbytes: int) -> None:
        """Another process of the container holds `nbytes` on this GPU (its own pid, as in NVML)."""
        helper = self.helpers.get(name)
        if helper is None:
            helper = subprocess.Popen(
                _HELPER, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            self.helpers[name] = helper
        alloc = gpus.Allocation(self.root, self.uuids[rank], OTHER_TAG, pid=helper.pid)
        alloc.add(nbytes)
        self.other_allocations.append(alloc)

    def lost(self, rank: int) -> bool:
        return gpus.read_device(self.root, self.uuids[rank]).lost

    def vmm(self) -> bool:
        """Whether every GPU's driver supports virtual memory management (device.json's `vmm`)."""
        return all(gpus.read_device(self.root, u).vmm for u in self.uuids)

    def release_all(self) -> None:
        for alloc in self.allocations:
            alloc.release()
        self.tags = [{} for _ in self.uuids]
        for other in self.other_allocations:
            other.release()
        self.other_allocations = []
        for helper in self.helpers.values():
            with contextlib.suppress(OSError):
                if helper.stdin is not None:
                    helper.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                helper.wait(timeout=2)
        self.helpers = {}


def select_gpus(env: Mapping[str, str]) -> list[str]:
    """NVIDIA_VISIBLE_DEVICES in order, narrowed by CUDA_VISIBLE_DEVICES when that is set."""
    uuids = gpus.visible_uuids(env)
    narrowed = env.get("CUDA_VISIBLE_DEVICES")
    if narrowed is None or not narrowed.strip():
        return uuids
    chosen = []
    for item in (x.strip() for x in narrowed.split(",") if x.strip()):
        if item.isdigit() and int(item) < len(uuids):
            chosen.append(uuids[int(item)])
        elif item in uuids:
            chosen.append(item)
        else:
            break  # CUDA stops enumerating at the first invalid entry
    return chosen
