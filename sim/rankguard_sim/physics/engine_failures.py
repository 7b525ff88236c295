"""How the simulated engine fails: PyTorch's OOM and vLLM's start-up errors, in their own words.

The messages are PyTorch's and vLLM's formats, because the agent recognises the printed
text (never these classes): vLLM's are rendered from the recorded snapshot's templates
(`vllm_snapshot.message`), PyTorch's follow c10's allocator format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rankguard_sim.physics.scenario_data import GIB, KIB, MIB
from rankguard_sim.vllm_snapshot import arity, format_gib, message

# Outcome reasons (the world's words; the agent recognises the printed messages instead).
CUDA_OOM = "CUDAOutOfMemory"
STARTUP_FREE_MEMORY = "FreeMemoryBelowRequested"
KV_CACHE_TOO_SMALL = "KVCacheTooSmall"
NO_KV_MEMORY = "NoKVCacheMemory"
GPU_LOST = "GpuLost"


# ---------------------------------------------------------------------------------------------
# Messages (formats of PyTorch and vLLM)


def format_size(nbytes: int) -> str:
    """PyTorch's c10 `format_size`: bytes up to 1 KiB, then KiB/MiB/GiB with two decimals."""
    if nbytes <= KIB:
        return f"{nbytes} bytes"
    if nbytes <= MIB:
        return f"{nbytes / KIB:.2f} KiB"
    if nbytes <= GIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def torch_allocation_size(nbytes: int) -> int:
    """The block size PyTorch's caching allocator asks the driver for (what "Tried to allocate" shows).

    Small requests come from 2 MiB segments, requests under 10 MiB from 20 MiB segments,
    and larger ones are rounded up to a multiple of 2 MiB.
    """
    if nbytes <= MIB:
        return 2 * MIB
    if nbytes < 10 * MIB:
        return 20 * MIB
    return 2 * MIB * math.ceil(nbytes / (2 * MIB))


class EngineFailure(Exception):
    """The engine stops; `rank` is the (global) rank that caused it, if one did. Its GPU is the
    process's `device` (PyTorch's "GPU i", `cuda:i`), the rank itself unless the world spans
    nodes (then the rank's local index on its node)."""

    reason = "EngineError"

    def __init__(self, rank: int | None, phase: str) -> None:
        super().__init__(rank, phase)
        self.rank = rank
        self.phase = phase

    @property
    def requested_bytes(self) -> int | None:
        return None

    @property
    def free_bytes(self) -> int | None:
        return None

    def message(self) -> str:
        return f"engine failed during {self.phase}"

    def __str__(self) -> str:
        return self.message()


class CudaOutOfMemory(EngineFailure):
    """A rank asked its GPU for more than was free: PyTorch's torch.OutOfMemoryError."""

    reason = CUDA_OOM

    def __init__(
        self,
        rank: int,
        phase: str,
        *,
        nbytes: int,
        free: int,
        total: int,
        process_bytes: int,
        torch_allocated: int,
        private_pools: int,
        others: Sequence[tuple[int, int]] = (),
        what: str = "",
        device: int | None = None,
    ) -> None:
        super().__init__(rank, phase)
        self.device = rank if device is None else device
        self.what = what  # the ledger tag being allocated (weights, kv_cache, logits, ...)
        self.nbytes = nbytes
        self.tried = torch_allocation_size(nbytes)
        self.free = free
        self.total = total
        self.process_bytes = process_bytes
        self.torch_allocated = torch_allocated
        self.private_pools = private_pools
        self.others = tuple(others)

    @property
    def requested_bytes(self) -> int | None:
        return self.tried

    @property
    def free_bytes(self) -> int | None:
        return self.free

    def message(self) -> str:
        others = "".join(f"Process {pid} has {format_size(n)} memory in use. " for pid, n in self.others)
        pools = (
            f"with {format_size(self.private_pools)} allocated in private pools (e.g., CUDA Graphs), "
            if self.private_pools
            else ""
        )
        return (
            f"CUDA out of memory. Tried to allocate {format_size(self.tried)}. "
            f"GPU {self.device} has a total capacity of {format_size(self.total)} of which "
            f"{format_size(self.free)} is free. {others}Including non-PyTorch memory, this process has "
            f"{format_size(self.process_bytes)} memory in use. Of the allocated memory "
            f"{format_size(self.torch_allocated)} is allocated by PyTorch, {pools}and "
            f"{format_size(0)} is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


def _figures(oom: CudaOutOfMemory) -> dict[str, Any]:
    """An OOM's figures, for a failure vLLM words its own way around the same allocation."""
    return {
        "nbytes": oom.nbytes,
        "free": oom.free,
        "total": oom.total,
        "process_bytes": oom.process_bytes,
        "torch_allocated": oom.torch_allocated,
        "private_pools": oom.private_pools,
        "others": oom.others,
        "what": oom.what,
        "device": oom.device,
    }


class SamplerWarmupOOM(CudaOutOfMemory):
    """vLLM wraps an OOM while pre-allocating the sampler's logits buffers in its own advice."""

    def __init__(self, oom: CudaOutOfMemory, num_reqs: int) -> None:
        super().__init__(
            oom.rank if oom.rank is not None else 0,
            "sampler-warmup",
            **_figures(oom),
        )
        self.num_reqs = num_reqs

    def advice(self) -> str:
        return (
            f"CUDA out of memory occurred when warming up sampler with {self.num_reqs} dummy requests. "
            "Please try lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine."
        )


class TorchCapOOM(CudaOutOfMemory):
    """vLLM 0.34 caps torch's caching allocator after warm-up (set_per_process_memory_fraction):
    an allocation that would take torch's reservation past the cap is refused inside torch,
    whatever the GPU has free (c10's preemptive rejection, rendered from the snapshot)."""

    def __init__(self, oom: CudaOutOfMemory, cap: int) -> None:
        super().__init__(
            oom.rank if oom.rank is not None else 0,
            oom.phase,
            **_figures(oom),
        )
        self.cap = cap

    def message(self) -> str:
        # c10 ends the fragment with the requested size (format_size) and a full stop
        return f"{message('torch_oom_fraction')}{format_size(self.tried)}."


class StartupFreeMemoryError(EngineFailure):
    """vLLM's check in init_device: free memory after NCCL init below total × utilisation."""

    reason = STARTUP_FREE_MEMORY

    def __init__(
        self,
        rank: int,
        *,
        free: int,
        total: int,
        utilization: float,
        requested: int,
        device: int | None = None,
    ) -> None:
        super().__init__(rank, "init-device")
        self.device = rank if device is None else device
        self.free = free
        self.total = total
        self.utilization = utilization
        self.requested = requested

    @property
    def requested_bytes(self) -> int | None:
        return self.requested

    @property
    def free_bytes(self) -> int | None:
        return self.free

    def message(self) -> str:
        return message(
            "startup_free_too_low",
            f"cuda:{self.device}",
            format_gib(self.free),
            format_gib(self.total),
            self.utilization,
            format_gib(self.requested),
        )


def kv_memory_hint(extensible: bool, after_warmup: bool, utilization: float) -> str:
    """vLLM 0.34's `_more_kv_cache_memory_hint` (vllm/v1/core/kv_cache_planning.py; an f-string
    the snapshot records only as the `hint` value of no_kv_memory and kv_too_small)."""
    if not extensible:
        return (
            "Try increasing `gpu_memory_utilization` when initializing the engine (this flag also "
            "controls CPU memory reservation on the CPU backend, despite its name)."
        )
    used_by = (
        "the model, its activations, CUDA graphs and warmup"
        if after_warmup
        else "the model and its activations"
    )
    graphs = (
        " CUDA graphs take less with fewer or smaller capture sizes in the compilation config."
        if after_warmup
        else ""
    )
    if utilization < 1.0:
        return (
            f"The KV cache gets what is left after {used_by} within `gpu_memory_utilization`={utilization}; "
            "increase it (with the extensible KV cache it defaults to 1.0) or decrease `max_model_len` "
            f"or `max_num_seqs`.{graphs}"
        )
    return (
        f"The extensible KV cache already takes all device memory left after {used_by}; decrease "
        f"`max_model_len` or `max_num_seqs`, or the model needs a device with more memory.{graphs}"
    )


class NoKVCacheMemory(EngineFailure):
    reason = NO_KV_MEMORY

    def __init__(self, rank: int, available: int, hint: str = "") -> None:
        super().__init__(rank, "kv-cache")
        self.available = available
        self.hint = hint  # 0.34's message carries one (kv_memory_hint); 0.33's has it built in

    @property
    def free_bytes(self) -> int | None:
        return max(0, self.available)

    def message(self) -> str:
        return message("no_kv_memory", *([self.hint] if arity("no_kv_memory") else []))


class KVCacheTooSmall(EngineFailure):
    reason = KV_CACHE_TOO_SMALL

    def __init__(
        self, rank: int, *, max_model_len: int, needed: int, available: int, estimated: int, hint: str = ""
    ) -> None:
        super().__init__(rank, "kv-cache")
        self.max_model_len = max_model_len
        self.needed = needed
        self.available = available
        self.estimated = estimated
        self.hint = hint  # 0.34's message carries one (kv_memory_hint)

    @property
    def requested_bytes(self) -> int | None:
        return self.needed

    @property
    def free_bytes(self) -> int | None:
        return self.available

    def message(self) -> str:
        # The estimate sentence is vLLM's `estimated_msg` (not in the snapshot: the fake's own
        # wording, kept from before); vLLM leaves it out when nothing fits.
        estimated = (
            f"Based on the available memory, the estimated maximum model length is {self.estimated}. "
            if self.estimated > 0
            else ""
        )
        values = [
            self.max_model_len,
            format_gib(self.needed),
            format_gib(self.available),
            estimated,
            self.hint,
        ]
        return message("kv_too_small", *values[: arity("kv_too_small")])


class GpuLost(EngineFailure):
    reason = GPU_LOST

    def message(self) -> str:
        return "CUDA error: unspecified launch failure (the GPU has fallen off the bus)"
