"""A simulated node's GPUs, handed out to pods the way the NVIDIA device plugin does.

The process kubelet owns one `NodeGpus`: it creates the node's devices (docs/sim-world.md,
UUIDs seeded by the node name), gives each pod whole GPUs and takes them back, and sets
the world's facts on them before a container starts (the scenario's communicator cost).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from . import gpus as simgpus
from .scenario_data import Scenario
from .scenario_file import load_scenario

GIB = 1 << 30
DEFAULT_GPU_TOTAL_BYTES = 80 * GIB


class NodeGpus:
    """The node's GPUs and which pod (by uid) holds each. Thread-safe."""

    def __init__(self, root: Path, count: int, total_bytes: int | None, scenario: str | None) -> None:
        self.root = root
        self.count = count
        self.scenario: Scenario | None = None
        self.name = simgpus.DEFAULT_NAME
        self.total_bytes = total_bytes or DEFAULT_GPU_TOTAL_BYTES
        if scenario:
            self.scenario = load_scenario(scenario)
            self.name = f"{self.scenario.gpu.name} (simulated)"
            self.total_bytes = total_bytes or int(self.scenario.gpu.total_bytes)
        self.uuids: list[str] = []
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}  # uuid -> pod uid

    def create(self, seed: str) -> None:
        self.uuids = simgpus.create_gpus(self.root, self.count, self.total_bytes, seed=seed, name=self.name)

    def free(self) -> list[str]:
        with self._lock:
            return [u for u in self.uuids if u not in self._owner]

    def acquire(self, uid: str, count: int) -> list[str] | None:
        with self._lock:
            free = [u for u in self.uuids if u not in self._owner]
            if count > len(free):
                return None
            got = free[:count]
            for u in got:
                self._owner[u] = uid
            return got

    def release(self, uid: str) -> None:
        """Give the pod's GPUs back; what its dead processes still hold there goes too."""
        with self._lock:
            for u in [u for u, owner in self._owner.items() if owner == uid]:
                del self._owner[u]
        with contextlib.suppress(OSError):
            simgpus.cleanup_dead(self.root)

    def set_comm_init(self, uuids: list[str]) -> None:
        """The world's fact for each rank: what CUDA context + NCCL cost on that GPU."""
        if self.scenario is None:
            return
        for rank, uuid in enumerate(uuids):
            simgpus.set_comm_init_bytes(self.root, uuid, int(self.scenario.comm_init_bytes(rank)))
