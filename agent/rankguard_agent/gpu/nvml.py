"""The NVML backend (nvidia-ml-py, imported as pynvml).

pynvml is imported lazily and may be passed in (`nvml=`): the module IS the GPU boundary,
so tests hand in a small fake module with the same functions and error classes.

Errors are per GPU: NotSupported, GpuIsLost and friends become that rank's `error`
(named after NVML's error class), and the other ranks keep reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from rankguard_agent.gpu.driver import cuda_vmm_supported
from rankguard_agent.gpu.interface import (
    GpuReading,
    GpuUnavailable,
    ProcessMemory,
    RankDevice,
    failed_reading,
)
from rankguard_agent.gpu.visible import Selection, apply_cuda_visible, apply_nvidia_visible

log = logging.getLogger("rankguard_agent.gpu.nvml")

# Errors from the v2 memory call that mean "this driver has no v2": fall back to v1 for good.
_NO_V2 = {"FunctionNotFound", "NotSupported", "ArgumentVersionMismatch", "InvalidArgument"}
_HANDLE_RETRY_SECONDS = 5.0


def error_name(exc: BaseException) -> str:
    """NVMLError_GpuIsLost -> "GpuIsLost"; anything else -> its type and message."""
    cls = type(exc).__name__
    if cls.startswith("NVMLError_"):
        return cls[len("NVMLError_") :]
    return f"{cls}: {exc}"[:200]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _import_pynvml() -> Any:
    try:
        import pynvml  # noqa: PLC0415 - only NVML hosts pay for it
    except ImportError as e:
        raise GpuUnavailable(f"pynvml (nvidia-ml-py) is not importable: {e}") from None
    return pynvml


class NvmlBackend:
    name = "nvml"
    simulated = False

    def __init__(self, nvml: Any | None = None, env: Mapping[str, str] | None = None) -> None:
        self._nvml = nvml if nvml is not None else _import_pynvml()
        env = os.environ if env is None else env
        self._env = dict(env)
        try:
            self._nvml.nvmlInit()
        except Exception as e:
            # The usual cause: no libnvidia-ml.so.1 (no driver mounted into this container).
            raise GpuUnavailable(f"NVML could not start ({error_name(e)}); no GPU readings") from None
        self.warnings: list[str] = []
        self._devices: list[RankDevice] = []
        self._handles: list[Any | None] = []
        self._targets: list[tuple[int | None, str | None]] = []  # (nvml index, mig uuid)
        self._v2: list[bool] = []
        self._next_retry: list[float] = []
        self._open(env)

    # -- rank mapping ------------------------------------------------------------------
    def _open(self, env: Mapping[str, str]) -> None:
        nvml = self._nvml
        count = int(nvml.nvmlDeviceGetCount())
        uuids: list[str] = []
        names: list[str] = []
        for i in range(count):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                uuids.append(_text(nvml.nvmlDeviceGetUUID(h)))
                names.append(_text(nvml.nvmlDeviceGetName(h)))
            except Exception as e:
                uuids.append("")
                names.append("")
                self.warnings.append(f"NVML device {i}: {error_name(e)}")
        first = apply_nvidia_visible(uuids, env.get("NVIDIA_VISIBLE_DEVICES"))
        self._note(first)
        # Candidates in CUDA's enumeration order; index into NVML's (PCI) order.
        cand_nvml: list[int | None] = []
        cand_uuid: list[str] = []
        for t in first.targets:
            cand_nvml.append(t.index)
            cand_uuid.append(uuids[t.index] if t.index is not None else (t.mig_uuid or ""))
        order = self._cuda_order(cand_nvml, names, env)
        cand_nvml = [cand_nvml[i] for i in order]
        cand_uuid = [cand_uuid[i] for i in order]
        second = apply_cuda_visible(cand_uuid, env.get("CUDA_VISIBLE_DEVICES"))
        self._note(second)
        for rank, t in enumerate(second.targets):
            if t.index is not None:
                nvml_index, uuid = cand_nvml[t.index], cand_uuid[t.index]
                mig = uuid if nvml_index is None else None
            else:
                nvml_index, uuid, mig = None, t.mig_uuid or "", t.mig_uuid
            self._targets.append((nvml_index, mig))
            self._handles.append(None)
            self._v2.append(hasattr(nvml, "nvmlMemory_v2"))
            self._next_retry.append(0.0)
            name = names[nvml_index] if nvml_index is not None else ""
            self._devices.append(RankDevice(rank=rank, uuid=uuid, name=name))
            self._acquire(rank)
        for w in self.warnings:
            log.warning("%s", w)

    def _note(self, sel: Selection) -> None:
        if sel.warning:
            self.warnings.append(sel.warning)

    def _cuda_order(self, nvml_idx: list[int | None], names: list[str], env: Mapping[str, str]) -> list[int]:
        """CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID (NVML's order).

        Identical GPUs tie, and ties keep PCI order, so only mixed boxes differ; there the
        compute capability approximates CUDA's heuristic, and a warning says to pin it.
        """
        identity = list(range(len(nvml_idx)))
        if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").upper() == "PCI_BUS_ID":
            return identity
        kinds = {names[i] for i in nvml_idx if i is not None}
        if len(kinds) <= 1:
            return identity
        self.warnings.append(
            "GPUs of different kinds and CUDA_DEVICE_ORDER is not PCI_BUS_ID: rank order follows "
            "compute capability as an approximation of CUDA's; set CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
        caps: list[tuple[int, int]] = []
        for i in nvml_idx:
            try:
                h = self._nvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = self._nvml.nvmlDeviceGetCudaComputeCapability(h)
                caps.append((int(major), int(minor)))
            except Exception:
                caps.append((0, 0))
        return sorted(identity, key=lambda k: (-caps[k][0], -caps[k][1]))

    def _acquire(self, rank: int) -> Any | None:
        """Open the rank's handle; a failure is remembered and retried now and then."""
        nvml_index, mig = self._targets[rank]
        try:
            if mig is not None:
                h = self._nvml.nvmlDeviceGetHandleByUUID(mig)
            else:
                h = self._nvml.nvmlDeviceGetHandleByIndex(nvml_index)
        except Exception as e:
            dev = self._devices[rank]
            self._devices[rank] = RankDevice(dev.rank, dev.uuid, dev.name, error_name(e))
            self._next_retry[rank] = time.monotonic() + _HANDLE_RETRY_SECONDS
            return None
        self._handles[rank] = h
        dev = self._devices[rank]
        if dev.error is not None:
            self._devices[rank] = RankDevice(dev.rank, dev.uuid, dev.name)
        return h

    # -- the interface -----------------------------------------------------------------
    def ranks(self) -> list[RankDevice]:
        return list(self._devices)

    def read(self, rank: int) -> GpuReading:
        dev = self._devices[rank]
        h = self._handles[rank]
        if h is None:
            if time.monotonic() < self._next_retry[rank]:
                return failed_reading(rank, dev.uuid, dev.error or "NoHandle")
            h = self._acquire(rank)
            if h is None:
                return failed_reading(rank, dev.uuid, self._devices[rank].error or "NoHandle")
        try:
            return self._memory(rank, dev.uuid, h)
        except Exception as e:
            return failed_reading(rank, dev.uuid, error_name(e))

    def _memory(self, rank: int, uuid: str, h: Any) -> GpuReading:
        nvml = self._nvml
        if self._v2[rank]:
            try:
                m = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
            except (TypeError, AttributeError):
                self._v2[rank] = False  # an old pynvml without the version argument
            except Exception as e:
                if error_name(e) not in _NO_V2:
                    raise
                self._v2[rank] = False
            else:
                total, free, reserved = int(m.total), int(m.free), int(m.reserved)
                # v2 `used` leaves out `reserved`; report used as total - free, like v1.
                return GpuReading(rank, uuid, total, max(0, total - free), free, reserved)
        m = nvml.nvmlDeviceGetMemoryInfo(h)
        total, free = int(m.total), int(m.free)
        return GpuReading(rank, uuid, total, max(0, total - free), free, 0)

    def processes(self, rank: int) -> list[ProcessMemory] | None:
        """None when NVML cannot list them (no handle, an error)."""
        h = self._handles[rank]
        if h is None:
            return None
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception as e:
            log.debug("rank %d: process list unavailable: %s", rank, error_name(e))
            return None
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out.append(ProcessMemory(pid=int(p.pid), used_bytes=None if used is None else int(used)))
        return out

    def vmm_supported(self) -> bool | None:
        """Whether the CUDA driver offers virtual memory management on every device the engine
        sees (NVML does not say; libcuda does, asked from a child process: gpu/driver.py)."""
        return cuda_vmm_supported(self._env)

    def communicator_init(self, rank: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # NCCL allocates on the real GPU by itself

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as e:
            log.debug("nvmlShutdown: %s", error_name(e))
