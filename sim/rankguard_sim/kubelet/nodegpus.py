"""A simulated node's GPUs, handed out to pods the way the NVIDIA device plugin does.

The process kubelet owns one `NodeGpus`: it creates the node's devices (docs/sim-world.md,
UUIDs seeded by the node name), gives each pod whole GPUs and takes them back, and sets
the world's facts on them before a container starts (the scenario's communicator cost).

MIG (optional, `MigLayout`): besides its whole GPUs a node may have MIG-enabled GPUs, each
split into slices of given profiles, exposed as the device plugin's "mixed" strategy does:
one extended resource per profile, `nvidia.com/mig-<profile>` (e.g. nvidia.com/mig-3g.40gb),
whose devices are simulated GPUs of the slice's memory with "MIG-…" UUIDs. A container limit
`nvidia.com/mig-3g.40gb: 1` gets one (`acquire_slices`). `node_labels()` are the labels
NVIDIA GPU Feature Discovery puts on such a node (nodes.gfd_labels).

`vmm=False`: a node whose driver lacks virtual memory management (every device's `vmm`).
Neighbours (`start_neighbour`, physics/neighbour.py): processes outside any pod holding memory on
one of the node's GPUs, stopped with the node.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rankguard_agent.gpu.simfiles import DEFAULT_NAME
from rankguard_sim.kubelet.nodes import gfd_labels
from rankguard_sim.kubelet.pod.spec import MIG_RESOURCE_PREFIX
from rankguard_sim.physics import gpus as simgpus
from rankguard_sim.physics.neighbour import Growth, Neighbour, start_neighbour
from rankguard_sim.physics.scenario_data import GIB, Scenario
from rankguard_sim.physics.scenario_file import load_scenario

DEFAULT_GPU_TOTAL_BYTES = 80 * GIB
# NVML's profile names as the device plugin spells them: "<compute slices>g.<memory>gb", then
# attributes ("+me" becomes ".me"): 1g.10gb, 3g.40gb, 1g.10gb.me, 1g.20gb …
_PROFILE = re.compile(r"^(\d+)g\.(\d+)gb(?:\.[a-z0-9]+)*$")
_SIMULATED = " (simulated)"


def mig_resource(profile: str) -> str:
    return MIG_RESOURCE_PREFIX + profile


def profile_slices(profile: str) -> tuple[int, int]:
    """(compute slices, nominal GB) of a MIG profile name, e.g. "3g.40gb" -> (3, 40)."""
    m = _PROFILE.match(profile)
    if m is None:
        raise ValueError(f"{profile!r} is not a MIG profile name like 3g.40gb")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class MigLayout:
    """`gpus` MIG-enabled GPUs, each split into `profiles` (profile -> slices per GPU).

    A slice's memory is `memory[profile]` bytes when given, else the profile's share of the
    GPU: nominal GB over the card's nominal size (its total rounded to a multiple of 8 GiB),
    e.g. 3g.40gb on a 79.14 GiB A100 80GB is 40/80 of it, 39.57 GiB.
    """

    gpus: int
    profiles: Mapping[str, int]
    memory: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gpus < 0 or any(n < 0 for n in self.profiles.values()):
            raise ValueError("a MIG layout's counts cannot be negative")
        for profile in self.profiles:
            profile_slices(profile)

    def slice_bytes(self, profile: str, gpu_total_bytes: int) -> int:
        if profile in self.memory:
            return int(self.memory[profile])
        _, nominal_gb = profile_slices(profile)
        card_gib = max(8, round(gpu_total_bytes / GIB / 8) * 8)
        return min(gpu_total_bytes, gpu_total_bytes * nominal_gb // card_gib)

    def slices(self) -> dict[str, int]:
        """Profile -> slices on the node."""
        return {p: self.gpus * n for p, n in self.profiles.items() if self.gpus * n > 0}


class NodeGpus:
    """The node's GPUs and which pod (by uid) holds each. Thread-safe."""

    def __init__(
        self,
        root: Path,
        count: int,
        total_bytes: int | None,
        scenario: str | None,
        mig: MigLayout | None = None,
        *,
        vmm: bool = True,
    ) -> None:
        self.root = root
        self.count = count
        self.vmm = vmm
        self.neighbours: list[Neighbour] = []
        self.scenario: Scenario | None = None
        self.name = DEFAULT_NAME
        self.total_bytes = total_bytes or DEFAULT_GPU_TOTAL_BYTES
        if scenario:
            self.scenario = load_scenario(scenario)
            self.name = f"{self.scenario.gpu.name}{_SIMULATED}"
            self.total_bytes = total_bytes or int(self.scenario.gpu.total_bytes)
        self.mig = mig
        self.uuids: list[str] = []
        self.slices: dict[str, list[str]] = {}  # resource -> MIG device UUIDs
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}  # uuid -> pod uid

    @property
    def model(self) -> str:
        """The card's name as NVML reports it (what GPU Feature Discovery labels)."""
        return self.name.removesuffix(_SIMULATED)

    def create(self, seed: str) -> None:
        self.uuids = simgpus.create_gpus(
            self.root, self.count, self.total_bytes, seed=seed, name=self.name, vmm=self.vmm
        )
        self.slices = {}
        if self.mig is None:
            return
        index = self.count
        for profile, n in self.mig.slices().items():
            nbytes = self.mig.slice_bytes(profile, self.total_bytes)
            made = []
            for _ in range(n):
                uuid = "MIG-" + simgpus.gpu_uuid(f"{seed}/mig", index).removeprefix("GPU-")
                name = f"{self.model} MIG {profile}{_SIMULATED}"
                simgpus.write_device(self.root, simgpus.Device(uuid, index, name, nbytes, vmm=self.vmm))
                made.append(uuid)
                index += 1
            self.slices[mig_resource(profile)] = made

    def mig_resources(self) -> dict[str, str]:
        """The node's MIG extended resources (capacity = allocatable): resource -> count."""
        return {resource: str(len(uuids)) for resource, uuids in self.slices.items()}

    def node_labels(self) -> dict[str, str]:
        """GPU Feature Discovery's labels for this node (its "mixed" strategy with MIG)."""
        mig = []
        if self.mig is not None:
            for profile, n in self.mig.slices().items():
                gi, _ = profile_slices(profile)
                mig.append((profile, n, self.mig.slice_bytes(profile, self.total_bytes), gi))
        parents = self.mig.gpus if self.mig is not None else 0
        return gfd_labels(self.model, self.total_bytes, self.count + parents, mig)

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

    def acquire_slices(self, uid: str, wanted: Mapping[str, int]) -> dict[str, list[str]] | None:
        """MIG devices per resource for a pod (all or nothing); None when any is short."""
        with self._lock:
            got: dict[str, list[str]] = {}
            for resource, count in wanted.items():
                free = [u for u in self.slices.get(resource, []) if u not in self._owner]
                if count > len(free):
                    return None
                got[resource] = free[:count]
            for uuids in got.values():
                for u in uuids:
                    self._owner[u] = uid
            return got

    def free_slices(self, resource: str) -> list[str]:
        with self._lock:
            return [u for u in self.slices.get(resource, []) if u not in self._owner]

    def release(self, uid: str) -> None:
        """Give the pod's GPUs back; what its dead processes still hold there goes too."""
        with self._lock:
            for u in [u for u, owner in self._owner.items() if owner == uid]:
                del self._owner[u]
        with contextlib.suppress(OSError):
            simgpus.cleanup_dead(self.root)

    def start_neighbour(self, gpu: int | str, hold: int, steps: Sequence[Growth] = ()) -> Neighbour:
        """A neighbour on GPU `gpu` (its index on the node, or its UUID) holding `hold` bytes and
        growing per `steps`; `.grow(n)` grows it at once, `.stop()` ends it (so does `stop_neighbours`)."""
        uuid = self.uuids[gpu] if isinstance(gpu, int) else gpu
        found = start_neighbour(self.root, uuid, hold, steps)
        self.neighbours.append(found)
        return found

    def stop_neighbours(self) -> None:
        for n in self.neighbours:
            n.stop()
        self.neighbours = []

    def set_comm_init(self, uuids: list[str], argv: list[str] | None = None) -> None:
        """The world's fact for each rank: what CUDA context + NCCL cost on that GPU.

        The pod's i-th GPU is rank i, or, for a node of a multi-node vLLM (`vllm serve …
        --node-rank r` in the container's command line), global rank r × len(uuids) + i.
        """
        if self.scenario is None:
            return
        first = node_rank(argv or []) * len(uuids)
        for i, uuid in enumerate(uuids):
            simgpus.set_comm_init_bytes(self.root, uuid, int(self.scenario.comm_init_bytes(first + i)))


def node_rank(argv: list[str]) -> int:
    """`--node-rank` (or `-r`) of a `vllm serve` command line, wherever it is in the argv (the
    agent's launcher runs `… -- vllm serve …`); 0 when absent or not a number."""
    if "serve" not in argv:
        return 0
    found = "0"
    args = argv[argv.index("serve") :]
    for i, arg in enumerate(args):
        if arg in ("--node-rank", "--node_rank", "-r") and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(("--node-rank=", "--node_rank=")):
            found = arg.split("=", 1)[1]
    return int(found) if found.isdigit() else 0
