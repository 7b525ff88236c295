"""GPU backends behind one small interface: what the sampler and the probe read.

A backend maps the pod's ranks (rank i = the i-th GPU the engine sees) to devices and
answers one reading per rank. A failing GPU answers a reading with `error` set; it never
raises, so one lost GPU cannot stop the sampler from reporting the others.

The probe's communicator init is where real and simulated GPUs differ, so the backend
answers it too (`communicator_init`): nothing above this boundary knows the sandbox.

`open_backend` imports the chosen implementation lazily: the sim backend never loads
pynvml, and a host without libnvidia-ml gets `GpuUnavailable` with a clear message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

# Where the simulated GPUs live is part of their on-disk contract (simfiles).
from rankguard_agent.gpu.simfiles import SIM_ROOT_ENV

BACKENDS = ("auto", "nvml", "sim")


class GpuUnavailable(RuntimeError):
    """The backend cannot start at all (no NVML library, no sim root, ...)."""


@dataclass(frozen=True, slots=True)
class RankDevice:
    """Which device serves a rank. `error` is set when the device could not be opened."""

    rank: int
    uuid: str
    name: str = ""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One memory reading. `used_bytes` counts driver-reserved memory, as NVML v1 does."""

    rank: int
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int = 0
    error: str | None = None  # e.g. "GpuIsLost", "NotSupported": the figures are then 0


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """A process holding memory on a rank's GPU (NVML's compute processes)."""

    pid: int
    used_bytes: int | None  # None where the driver cannot say (NVML_VALUE_NOT_AVAILABLE)


class GpuBackend(Protocol):
    name: str
    # True where memory is simulated: communicator_init itself takes the memory, so even a
    # CPU (gloo) probe, whose init touches no GPU, measures the communicator's cost.
    simulated: bool

    def ranks(self) -> list[RankDevice]:
        """The pod's ranks in order: rank i is the i-th device CUDA shows the engine."""

    def read(self, rank: int) -> GpuReading:
        """One reading of the rank's GPU. Never raises: a failure is the reading's `error`."""

    def processes(self, rank: int) -> list[ProcessMemory]:
        """Processes holding memory on the rank's GPU (empty where unknown)."""

    def communicator_init(self, rank: int) -> contextlib.AbstractContextManager[None]:
        """Held around a probe rank's communicator init and warm-up, on the rank's GPU.

        Real GPUs: nothing (NCCL allocates by itself). Simulated: holds the device's
        communicator cost until the block ends, and raises a CUDA-style out-of-memory
        RuntimeError at entry when that cost does not fit.
        """

    def close(self) -> None:
        """Release the backend (NVML shutdown)."""


def failed_reading(rank: int, uuid: str, error: str) -> GpuReading:
    return GpuReading(rank=rank, uuid=uuid, total_bytes=0, used_bytes=0, free_bytes=0, error=error)


class NoGpuBackend:
    """Stands in when the real backend cannot start: the agent keeps serving, with no ranks."""

    name = "none"
    simulated = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def ranks(self) -> list[RankDevice]:
        return []

    def read(self, rank: int) -> GpuReading:
        return failed_reading(rank, "", self.reason)

    def processes(self, rank: int) -> list[ProcessMemory]:
        return []

    def communicator_init(self, rank: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        return None


def resolve_backend_kind(kind: str, env: Mapping[str, str]) -> str:
    """`auto` means sim inside the sandbox world (its root is set), NVML everywhere else."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown GPU backend {kind!r}; choose one of {', '.join(BACKENDS)}")
    if kind == "auto":
        return "sim" if env.get(SIM_ROOT_ENV) else "nvml"
    return kind


def open_backend(kind: str, env: Mapping[str, str]) -> GpuBackend:
    """Open the named backend for the ranks this process sees. Raises GpuUnavailable."""
    resolved = resolve_backend_kind(kind, env)
    if resolved == "sim":
        from rankguard_agent.gpu.sim import SimBackend  # noqa: PLC0415 - only the sandbox reads files

        root = env.get(SIM_ROOT_ENV)
        if not root:
            raise GpuUnavailable(f"the sim backend needs {SIM_ROOT_ENV} to name the simulated GPU root")
        return SimBackend(root, env)
    from rankguard_agent.gpu.nvml import NvmlBackend  # noqa: PLC0415 - keeps pynvml off sim hosts

    return NvmlBackend(env=env)


def release_communicators(env: Mapping[str, str], pids: Iterable[int]) -> None:
    """Tidy up after probe ranks that were killed inside `communicator_init`.

    A real GPU frees a dead process's memory by itself; the simulated world keeps its file
    (which counts for nothing once the pid is dead), so remove it.
    """
    root = env.get(SIM_ROOT_ENV)
    if root:
        from rankguard_agent.gpu.sim import release_communicators as release_sim  # noqa: PLC0415

        release_sim(root, pids)
