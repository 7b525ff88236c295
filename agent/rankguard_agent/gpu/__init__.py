"""GPU backends behind one small interface: what the sampler and the probe read.

A backend maps the pod's ranks (rank i = the i-th GPU the engine sees) to devices and
answers one reading per rank. A failing GPU answers a reading with `error` set; it never
raises, so one lost GPU cannot stop the sampler from reporting the others.

The probe's communicator init is where real and simulated GPUs differ, so the backend
answers it too (`communicator_init`): nothing above this boundary knows the sandbox.

`open_backend` imports the chosen implementation lazily: the sim backend never loads
pynvml, and a host without libnvidia-ml gets `GpuUnavailable` with a clear message.

This module is the room's face: the interface is defined in `interface` (which the backends
import, so none of them imports this module back) and handed on from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rankguard_agent.gpu.driver import imex_channel_available
from rankguard_agent.gpu.interface import (
    GpuBackend,
    GpuReading,
    GpuUnavailable,
    NoGpuBackend,
    ProcessMemory,
    RankDevice,
)

# Where the simulated GPUs live is part of their on-disk contract (simfiles).
from rankguard_agent.gpu.simfiles import SIM_ROOT_ENV

BACKENDS = ("auto", "nvml", "sim")

__all__ = [
    "BACKENDS",
    "GpuBackend",
    "GpuReading",
    "GpuUnavailable",
    "NoGpuBackend",
    "ProcessMemory",
    "RankDevice",
    "imex_channel",
    "open_backend",
    "release_communicators",
    "resolve_backend_kind",
]


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


def imex_channel(backend: GpuBackend, env: Mapping[str, str]) -> bool | None:
    """Whether an IMEX channel opens in this pod (vLLM's own test); None with no GPU backend."""
    if isinstance(backend, NoGpuBackend):
        return None
    return imex_channel_available(env)
