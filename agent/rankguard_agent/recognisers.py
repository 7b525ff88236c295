"""Recognisers for the engine's output lines that matter: PURE functions over one line.

Formats (see docs/agent.md for the sources):

- PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp, PyTorch >= 2.1):
  "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB
  of which 1.06 GiB is free. Process 4242 has 12.00 GiB memory in use. Including non-PyTorch
  memory, this process has 78.12 GiB memory in use. 80.00 GiB allowed; Of the allocated
  memory 75.50 GiB is allocated by PyTorch, with 3.25 GiB allocated in private pools (e.g.,
  CUDA Graphs), and 1.25 GiB is reserved by PyTorch but unallocated. ..."
  Sizes: "N bytes" up to 1 KiB, then "%.2f KiB|MiB|GiB".
- The same allocator before 2.1: "Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total
  capacity; 14.56 GiB already allocated; 10.81 MiB free; 14.60 GiB reserved in total by
  PyTorch)".
- A CUDA runtime error without figures: "CUDA error: out of memory".
- vLLM's startup check: "Free memory on device (1.5/79.19 GiB) on startup is less than
  desired GPU memory utilization (0.9, 71.27 GiB)".
- vLLM's KV-cache lines: "Available KV cache memory: %.2f GiB", "GPU KV cache size: %s
  tokens" (with thousands separators), "Maximum concurrency for %s tokens per request:
  %.2fx", "Model loading took %s GiB memory and %s seconds", and the start-up refusal "To
  serve at least one request with the models's max seq len (%d), (%s GiB KV cache is
  needed, which is larger than the available KV cache memory (%s GiB)", or "No available
  memory for the cache blocks" when nothing is left at all.

Every log prefix ("(Worker_TP1 pid=77) ERROR 10-02 12:00:00 [x.py:1] ...") is ignored:
the patterns are searched anywhere in the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1000,
    "kib": 1 << 10,
    "mb": 1000**2,
    "mib": 1 << 20,
    "gb": 1000**3,
    "gib": 1 << 30,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_NUM = r"\d[\d,]*(?:\.\d+)?"
_SIZE = rf"({_NUM})\s*(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
GIB = 1 << 30

_OOM_MARK = re.compile(r"CUDA out of memory|CUDA error: out of memory", re.IGNORECASE)
_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
_NEW_CAPACITY = re.compile(rf"GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE} is free")
_OLD_CAPACITY = re.compile(
    rf"\(GPU (\d+); {_SIZE} total capacity; (?:{_SIZE} already allocated; )?{_SIZE} free"
)
_OTHER_PROC = re.compile(rf"Process (\d+) has {_SIZE} memory in use")
_THIS_PROC = re.compile(rf"this process has {_SIZE} memory in use")
_ALLOCATED = re.compile(rf"Of the allocated memory {_SIZE} is allocated by PyTorch")
_PRIVATE = re.compile(rf"with {_SIZE} allocated in private pools")
_UNALLOCATED = re.compile(rf"and {_SIZE} is reserved by PyTorch but unallocated")
_STARTUP_FREE = re.compile(
    rf"Free memory on device(?: \S+)? \(({_NUM})/({_NUM}) GiB\) on startup is less than desired "
    rf"GPU memory utilization \(({_NUM}), ({_NUM}) GiB\)"
)
_DEVICE_INDEX = re.compile(r"Free memory on device cuda:(\d+)")

_AVAILABLE_KV = re.compile(rf"Available KV cache memory: ({_NUM}) GiB")
_KV_TOKENS = re.compile(rf"GPU KV cache size: ({_NUM}) tokens")
_MAX_CONC = re.compile(rf"Maximum concurrency for ({_NUM}) tokens per request: ({_NUM})x")
_MODEL_LOADING = re.compile(rf"Model loading took ({_NUM}) GiB(?: memory)?")
_KV_TOO_SMALL = re.compile(
    rf"max seq len \((\d+)\), \(?({_NUM}) GiB KV cache is needed, which is larger than the "
    rf"available KV cache memory \(({_NUM}) GiB\)"
)
_NO_KV_MEMORY = "No available memory for the cache blocks"
_KV_TOO_SMALL_OLD = re.compile(
    r"max seq len \((\d+)\) is larger than the maximum number of tokens that can be stored in "
    r"KV cache \((\d+)\)"
)

# Cheap pre-filter: nearly every line of a serving engine contains none of these.
_KEYWORDS = ("memory", "KV cache", "Maximum concurrency", "max seq len")

AVAILABLE_KV = "available_kv_memory"
KV_TOKENS = "kv_cache_tokens"
MAX_CONCURRENCY = "max_concurrency"
KV_TOO_SMALL = "kv_too_small"
MODEL_LOADING = "model_loading"


def parse_number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_size(number: str, unit: str) -> int:
    """ "20.00" "MiB" -> 20971520. PyTorch prints binary units; decimal ones are accepted too."""
    return round(parse_number(number) * _UNITS[unit.lower()])


def _size(m: re.Match[str] | None, group: int = 1) -> int | None:
    return None if m is None else parse_size(m.group(group), m.group(group + 1))


@dataclass(frozen=True)
class CudaOom:
    """A CUDA out-of-memory error and whatever figures its message carried."""

    text: str
    gpu_index: int | None = None
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    this_process_bytes: int | None = None
    other_processes: tuple[tuple[int, int], ...] = ()  # (pid, bytes), as PyTorch lists them
    allocated_bytes: int | None = None
    private_pool_bytes: int | None = None  # CUDA graphs' pools
    reserved_unallocated_bytes: int | None = None
    startup_check: bool = False  # vLLM's "free memory ... on startup" refusal


@dataclass(frozen=True)
class KVObservation:
    """A vLLM KV-cache line. `value` is bytes for memory kinds, tokens, or the factor."""

    kind: str
    value: float
    text: str


@dataclass(frozen=True)
class KVTooSmall:
    """vLLM refused to start: one max-length request does not fit the KV budget."""

    text: str
    max_seq_len: int | None = None
    needed_bytes: int | None = None
    available_bytes: int | None = None
    available_tokens: int | None = None


Recognised = CudaOom | KVObservation | KVTooSmall


def recognise_oom(line: str) -> CudaOom | None:
    if "out of memory" not in line and "Free memory on device" not in line:
        return None
    startup = _STARTUP_FREE.search(line)
    if startup is not None:
        dev = _DEVICE_INDEX.search(line)
        return CudaOom(
            text=line.strip(),
            gpu_index=int(dev.group(1)) if dev else None,
            requested_bytes=round(parse_number(startup.group(4)) * GIB),
            total_bytes=round(parse_number(startup.group(2)) * GIB),
            free_bytes=round(parse_number(startup.group(1)) * GIB),
            startup_check=True,
        )
    if _OOM_MARK.search(line) is None:
        return None
    gpu: int | None = None
    total = free = None
    new = _NEW_CAPACITY.search(line)
    if new is not None:
        gpu, total, free = int(new.group(1)), _size(new, 2), _size(new, 4)
    else:
        old = _OLD_CAPACITY.search(line)
        if old is not None:
            gpu, total, free = int(old.group(1)), _size(old, 2), _size(old, 6)
    return CudaOom(
        text=line.strip(),
        gpu_index=gpu,
        requested_bytes=_size(_TRIED.search(line)),
        total_bytes=total,
        free_bytes=free,
        this_process_bytes=_size(_THIS_PROC.search(line)),
        other_processes=tuple(
            (int(m.group(1)), parse_size(m.group(2), m.group(3))) for m in _OTHER_PROC.finditer(line)
        ),
        allocated_bytes=_size(_ALLOCATED.search(line)),
        private_pool_bytes=_size(_PRIVATE.search(line)),
        reserved_unallocated_bytes=_size(_UNALLOCATED.search(line)),
    )


def recognise_kv(line: str) -> KVObservation | KVTooSmall | None:
    if "max seq len" in line:
        m = _KV_TOO_SMALL.search(line)
        if m is not None:
            return KVTooSmall(
                text=line.strip(),
                max_seq_len=int(m.group(1)),
                needed_bytes=round(parse_number(m.group(2)) * GIB),
                available_bytes=round(parse_number(m.group(3)) * GIB),
            )
        old = _KV_TOO_SMALL_OLD.search(line)
        if old is not None:
            return KVTooSmall(
                text=line.strip(), max_seq_len=int(old.group(1)), available_tokens=int(old.group(2))
            )
    if _NO_KV_MEMORY in line:
        return KVTooSmall(text=line.strip(), available_bytes=0)
    if "KV cache" in line:
        m = _AVAILABLE_KV.search(line)
        if m is not None:
            return KVObservation(AVAILABLE_KV, float(round(parse_number(m.group(1)) * GIB)), line.strip())
        m = _KV_TOKENS.search(line)
        if m is not None:
            return KVObservation(KV_TOKENS, parse_number(m.group(1)), line.strip())
    if "Maximum concurrency" in line:
        m = _MAX_CONC.search(line)
        if m is not None:
            return KVObservation(MAX_CONCURRENCY, parse_number(m.group(2)), line.strip())
    if "Model loading took" in line:
        m = _MODEL_LOADING.search(line)
        if m is not None:
            return KVObservation(MODEL_LOADING, float(round(parse_number(m.group(1)) * GIB)), line.strip())
    return None


def recognise(line: str) -> Recognised | None:
    """The one thing this line says that rankguard cares about, or None (the usual case)."""
    if not any(k in line for k in _KEYWORDS):
        return None
    oom = recognise_oom(line)
    if oom is not None:
        return oom
    return recognise_kv(line)
