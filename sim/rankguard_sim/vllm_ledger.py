"""The fake vLLM's GPUs: the pod's simulated GPU files as the engine's `Ledger`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from rankguard_sim import gpus

ALLOCATION_TAG = "vllm"


class FileLedger:
    """The engine's view of its simulated GPUs: one allocation file per GPU for this process."""

    def __init__(self, root: str, uuids: Sequence[str], pid: int | None = None) -> None:
        self.root = root
        self.uuids = list(uuids)
        self.pid = os.getpid() if pid is None else pid
        self.allocations = [gpus.Allocation(root, u, ALLOCATION_TAG, pid=self.pid) for u in self.uuids]
        self.tags: list[dict[str, int]] = [{} for _ in self.uuids]

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

    def lost(self, rank: int) -> bool:
        return gpus.read_device(self.root, self.uuids[rank]).lost

    def release_all(self) -> None:
        for alloc in self.allocations:
            alloc.release()
        self.tags = [{} for _ in self.uuids]


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
