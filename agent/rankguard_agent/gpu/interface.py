"""What every GPU backend answers, and the readings it answers with: the one interface the
sampler and the probe read (this package's face hands it on). A failing GPU answers a reading
with `error` set; it never raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol


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

    def processes(self, rank: int) -> list[ProcessMemory] | None:
        """Processes holding memory on the rank's GPU; None when they cannot be listed now,
        which must not read as "no process" (the pod's own memory would pass for someone
        else's: others.py)."""

    def vmm_supported(self) -> bool | None:
        """Whether the driver under the pod's GPUs has virtual memory management on every
        device (vLLM 0.34's extensible KV cache needs it); None where it cannot say."""

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

    def processes(self, rank: int) -> list[ProcessMemory] | None:
        return None

    def vmm_supported(self) -> bool | None:
        return None

    def communicator_init(self, rank: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        return None
