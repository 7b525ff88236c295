"""Recognisers for the engine's output lines that matter: PURE functions over one line.

(Over 450 lines because every recogniser shares one grammar of numbers and sizes, one keyword
pre-filter and one order in `recognise_all` (a start-up refusal before the memory report that
shares its opening words); most of the length is the patterns and the dataclasses they fill.)

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
- The same allocator refusing up front under a memory fraction: "CUDA out of memory.
  Allocation was preemptively rejected because it would exceed per_process_memory_fraction
  limit. Requested size: 2.00 GiB...", and cuDNN's "CUDA ran out of memory outside PyTorch's
  allocator..." (no figures).
- A CUDA runtime error without figures: "CUDA error: out of memory", and cuBLAS failing to
  allocate its workspace or handle, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
  `cublasCreate(handle)`" (torch/lib/libtorch_cuda.so; the GPU is full, no figures).
- vLLM's startup checks (vllm/v1/worker/utils.py `request_memory`): "Free memory on device
  cuda:0 (1.5/79.19 GiB) on startup is less than desired GPU memory utilization (0.9, 71.27
  GiB)" and "... is less than the engine's budget after excluding external process's weights
  (0.9, 70.1 GiB)" (older vLLM names no device), and "Externally held weights on device cuda:0
  (75.0/79.19 GiB) exceed the desired GPU memory utilization (0.9, 71.27 GiB). ...": weights
  another process holds on the GPU (a zero-copy weight cache) are not below the utilisation's
  share, so nothing is left for the engine; `external_weight_bytes` carries them, and no free
  figure is printed.
- vLLM's per-worker memory report (printed by each worker in utilisation mode only): "Free
  memory on device (F/T GiB) on startup. Desired GPU memory utilization is (U, R GiB). Actual
  usage is C GiB for consumed memory (weights + non-torch), P GiB for peak activation, and G
  GiB for CUDAGraph memory. Replace ... `--kv-cache-memory=N1` (... GiB) to fit into requested
  memory, or `--kv-cache-memory=N2` (... GiB) to fully utilize gpu memory. Current kv cache
  memory in use is K GiB.", and "CUDA graph pool memory: X GiB (actual), Y GiB (estimated), ...".
  A line that carries such a report's marker but not every figure is `Unparsed`: counted by
  the caller, never acted upon.
- vLLM's KV-cache lines: "Available KV cache memory: %.2f GiB", "GPU KV cache size: %s
  tokens" (with thousands separators), "Maximum concurrency for %s tokens per request:
  %.2fx" (one line each in older vLLM; in 0.33 one line says both, and
  `recognise_all` returns both), "Model loading took %s GiB memory and %s seconds", and the
  start-up refusal "To serve at least one request with the model's max seq len (%d), (%s GiB
  KV cache is needed, which is larger than the available KV cache memory (%s GiB)", or "No available
  memory for the cache blocks" when nothing is left at all.
- vLLM 0.34's extensible KV cache: each worker's "Memory after warmup: ..." and the engine's
  "Disabling the extensible KV cache: <reason>. ..." (`recognisers_extensible`, whose lines
  `recognise_all` returns as `AfterWarmup` / `ExtensibleDisabled`).

Every log prefix ("(Worker_TP1 pid=77) ERROR 10-02 12:00:00 [x.py:1] ...") is ignored:
the patterns are searched anywhere in the line (`rankguard_agent.workers` reads the prefix).
The vLLM source of each message is recorded in rankguard_operator/vllm_snapshots/*/formats.json
(file:line); tests/unit/agent/wire/test_recognisers.py renders every one of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rankguard_agent.wire.recognisers_extensible import (
    KEYWORDS as EXTENSIBLE_KEYWORDS,
)
from rankguard_agent.wire.recognisers_extensible import (
    AfterWarmup,
    ExtensibleDisabled,
    UnreadLine,
    recognise_extensible,
)

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
# vLLM's format_gib prints round(bytes / 2**30, 2) as Python prints a float: "1.5", "0.0", "-1.8".
_GNUM = r"-?\d+(?:\.\d+)?"
_SIZE = rf"({_NUM})\s*(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
GIB = 1 << 30

_OOM_MARK = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|CUDA ran out of memory|CUBLAS_STATUS_ALLOC_FAILED"
    # the cudaMallocAsync backend's refusal, and the native allocator's with expandable segments or
    # throw_on_cudamalloc_oom (torch/lib/libc10_cuda.so, recorded in the snapshot)
    r"|would exceed allowed memory\. \(out of memory\)|failed with OOM on device",
    re.IGNORECASE,
)
# The device those two name: "Allocation on device 0 would ...", "... failed with OOM on device 0".
_ON_DEVICE = re.compile(r"(?:Allocation on device|failed with OOM on device) (\d+)")
# cuBLAS's own allocation failure (its handle or workspace), raised by torch as a CUDA error; it
# names no size and no GPU.
_CUBLAS_ALLOC = "CUBLAS_STATUS_ALLOC_FAILED"
_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
# The memory-fraction refusal names the size differently (recorded from torch 2.14).
_REQUESTED_SIZE = re.compile(rf"Requested size: {_SIZE}")
_NEW_CAPACITY = re.compile(rf"GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE} is free")
_OLD_CAPACITY = re.compile(
    rf"\(GPU (\d+); {_SIZE} total capacity; (?:{_SIZE} already allocated; )?{_SIZE} free"
)
_OTHER_PROC = re.compile(rf"Process (\d+) has {_SIZE} memory in use")
_THIS_PROC = re.compile(rf"this process has {_SIZE} memory in use")
_ALLOCATED = re.compile(rf"Of the allocated memory {_SIZE} is allocated by PyTorch")
_PRIVATE = re.compile(rf"with {_SIZE} allocated in private pools")
_UNALLOCATED = re.compile(rf"and {_SIZE} is reserved by PyTorch but unallocated")
# Two refusals share the start; what follows "less than" names the budget ("desired GPU memory
# utilization", or in 0.33 also "the engine's budget after excluding external process's weights").
_STARTUP_FREE = re.compile(
    rf"Free memory on device(?: \S+)? \(({_NUM})/({_NUM}) GiB\) on startup is less than "
    rf"[^()]*\(({_NUM}), ({_NUM}) GiB\)"
)
_DEVICE_INDEX = re.compile(r"(?:Free memory|Externally held weights) on device cuda:(\d+)")
# The third refusal of vLLM 0.33's request_memory: the weights a zero-copy loader maps from another
# process exceed total x utilisation, so the engine's own share would be <= 0 (no free figure).
_STARTUP_EXTERNAL = re.compile(
    rf"Externally held weights on device(?: \S+)? \(({_NUM})/({_NUM}) GiB\) exceed the desired GPU "
    rf"memory utilization \(({_NUM}), ({_NUM}) GiB\)"
)

_AVAILABLE_KV = re.compile(rf"Available KV cache memory: ({_NUM}) GiB")
# Older vLLM printed "GPU KV cache size: N tokens" alone; 0.33 prints "%s KV cache size: %s
# tokens, Maximum concurrency ..." where %s is the device kind (GPU, CPU, ...).
_KV_TOKENS = re.compile(rf"(?:^|\s)\S* ?KV cache size: ({_NUM}) tokens")
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

# The per-worker report, one search per figure: each is anchored on its own words, so the figures
# cannot be read from the wrong place, and a reworded or cut line lacks one and is Unparsed.
_WR_FREE = re.compile(rf"Free memory on device(?: \S+)? \(({_GNUM})/({_GNUM}) GiB\) on startup\.")
_WR_DESIRED = re.compile(rf"Desired GPU memory utilization is \(({_GNUM}), ({_GNUM}) GiB\)")
_WR_CONSUMED = re.compile(rf"Actual usage is ({_GNUM}) GiB for consumed memory")
_WR_PEAK = re.compile(rf"({_GNUM}) GiB for peak activation")
_WR_GRAPHS = re.compile(rf"({_GNUM}) GiB for CUDAGraph memory")
_WR_TO_REQUESTED = re.compile(rf"`--kv-cache-memory=(-?\d+)` \(({_GNUM}) GiB\) to fit into requested memory")
_WR_TO_GPU = re.compile(rf"`--kv-cache-memory=(-?\d+)` \(({_GNUM}) GiB\) to fully utilize gpu memory")
_WR_KV_NOW = re.compile(rf"Current kv cache memory in use is ({_GNUM}) GiB")
# Any of these says "this line is (part of) a worker's memory report".
_WR_MARKERS = (
    "Desired GPU memory utilization is",
    "for consumed memory (weights + non-torch)",
    "to fully utilize gpu memory",
    "Current kv cache memory in use is",
)
_GRAPH_POOL = re.compile(
    rf"CUDA graph pool memory: ({_GNUM}) GiB \(actual\)(?:, ({_GNUM}) GiB \(estimated\))?"
)
_GRAPH_POOL_MARKER = "CUDA graph pool memory:"
# printed per worker instead of the memory report when --kv-cache-memory-bytes is set
_INITIAL_FREE = re.compile(rf"Initial free memory ({_GNUM}) GiB, reserved ({_GNUM}) GiB memory for KV Cache")
_INITIAL_FREE_MARKER = "memory for KV Cache as specified by kv_cache_memory_bytes"
# A figure printed with 2 decimals of GiB is within 0.005 GiB of the exact one.
_GIB_ROUNDING = GIB // 200 + 1

# Cheap pre-filter: nearly every line of a serving engine contains none of these.
_KEYWORDS = ("memory", "KV cache", "Maximum concurrency", "max seq len", _CUBLAS_ALLOC, *EXTENSIBLE_KEYWORDS)

AVAILABLE_KV = "available_kv_memory"
KV_TOKENS = "kv_cache_tokens"
MAX_CONCURRENCY = "max_concurrency"
KV_TOO_SMALL = "kv_too_small"
MODEL_LOADING = "model_loading"
# Unparsed kinds: the snapshot's keys of the per-worker lines.
WORKER_MEMORY_REPORT = "worker_memory_report"
CUDA_GRAPH_POOL = "cuda_graph_pool"
INITIAL_FREE = "initial_free_memory"


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
    startup_check: bool = False  # vLLM's start-up refusals ("Free memory ... on startup", "Externally held")
    # the weights another process holds on the device, when vLLM refused because they exceed
    # total x utilisation ("Externally held weights on device ..."); None otherwise
    external_weight_bytes: int | None = None


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


@dataclass(frozen=True)
class WorkerMemoryReport:
    """One vLLM worker's own account of its memory at start-up (bytes are 0.01 GiB precise,
    except the two `--kv-cache-memory` figures, which vLLM prints in exact bytes)."""

    text: str
    free_bytes: int  # free on the device when the worker started
    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int  # total × utilisation
    consumed_bytes: int  # weights + non-torch (CUDA context, NCCL, ...)
    peak_activation_bytes: int
    cuda_graph_bytes: int
    kv_to_requested_bytes: int  # the KV budget that fits the requested share (may be < 0)
    kv_to_gpu_bytes: int  # the KV budget that fills the GPU's free memory at start-up
    kv_in_use_bytes: int


@dataclass(frozen=True)
class CudaGraphPool:
    """A worker's "CUDA graph pool memory: X GiB (actual), Y GiB (estimated), ..." line."""

    text: str
    actual_bytes: int
    estimated_bytes: int | None = None


@dataclass(frozen=True)
class InitialFree:
    """A worker's "Initial free memory X GiB, reserved Y GiB memory for KV Cache as specified by
    kv_cache_memory_bytes ..." line: the free memory vLLM's start-up check saw, on every start
    with a byte budget (where the memory report is not printed)."""

    text: str
    free_bytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class Unparsed:
    """A line that carries the marker of a report rankguard reads (`kind`) but not its figures:
    cut, garbled, or a format this agent does not know. Counted, never acted upon."""

    kind: str
    text: str


Recognised = (
    CudaOom
    | KVObservation
    | KVTooSmall
    | WorkerMemoryReport
    | CudaGraphPool
    | InitialFree
    | AfterWarmup
    | ExtensibleDisabled
    | Unparsed
)


def recognise_oom(line: str) -> CudaOom | None:
    if (
        "out of memory" not in line
        and "OOM on device" not in line
        and "Free memory on device" not in line
        and "Externally held weights" not in line
        and _CUBLAS_ALLOC not in line
    ):
        return None
    # vLLM's start-up refusals share one shape: (first/total GiB) ... (utilisation, requested GiB);
    # the first figure is the weights held outside, or the free memory
    for pattern, external in ((_STARTUP_EXTERNAL, True), (_STARTUP_FREE, False)):
        startup = pattern.search(line)
        if startup is None:
            continue
        dev = _DEVICE_INDEX.search(line)
        first = round(parse_number(startup.group(1)) * GIB)
        return CudaOom(
            text=line.strip(),
            gpu_index=int(dev.group(1)) if dev else None,
            requested_bytes=round(parse_number(startup.group(4)) * GIB),
            total_bytes=round(parse_number(startup.group(2)) * GIB),
            free_bytes=None if external else first,
            startup_check=True,
            external_weight_bytes=first if external else None,
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
        elif (dev := _ON_DEVICE.search(line)) is not None:
            gpu = int(dev.group(1))
    requested = _size(_TRIED.search(line))
    if requested is None:
        requested = _size(_REQUESTED_SIZE.search(line))
    return CudaOom(
        text=line.strip(),
        gpu_index=gpu,
        requested_bytes=requested,
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


def _gib(text: str) -> int:
    return round(float(text) * GIB)


def recognise_worker_report(line: str) -> WorkerMemoryReport | Unparsed | None:
    """vLLM's per-worker memory report; Unparsed when the line has its marker but not every
    figure, or figures that cannot be true together (a digit lost, free above total, ...)."""
    if not any(m in line for m in _WR_MARKERS):
        return None
    text = line.strip()
    found = [
        r.search(line)
        for r in (
            _WR_FREE,
            _WR_DESIRED,
            _WR_CONSUMED,
            _WR_PEAK,
            _WR_GRAPHS,
            _WR_TO_REQUESTED,
            _WR_TO_GPU,
            _WR_KV_NOW,
        )
    ]
    if any(m is None for m in found):
        return Unparsed(WORKER_MEMORY_REPORT, text)
    free, desired, consumed, peak, graphs, to_req, to_gpu, kv_now = (m for m in found if m is not None)
    report = WorkerMemoryReport(
        text=text,
        free_bytes=_gib(free.group(1)),
        total_bytes=_gib(free.group(2)),
        gpu_memory_utilization=float(desired.group(1)),
        requested_bytes=_gib(desired.group(2)),
        consumed_bytes=_gib(consumed.group(1)),
        peak_activation_bytes=_gib(peak.group(1)),
        cuda_graph_bytes=_gib(graphs.group(1)),
        kv_to_requested_bytes=int(to_req.group(1)),
        kv_to_gpu_bytes=int(to_gpu.group(1)),
        kv_in_use_bytes=_gib(kv_now.group(1)),
    )
    plausible = (
        0 <= report.free_bytes <= report.total_bytes
        and 0.0 < report.gpu_memory_utilization <= 1.0
        and min(report.requested_bytes, report.consumed_bytes, report.peak_activation_bytes) >= 0
        and min(report.cuda_graph_bytes, report.kv_in_use_bytes) >= 0
        # Each exact byte count is printed again in GiB: the two must agree, or digits were lost.
        and abs(report.kv_to_requested_bytes - _gib(to_req.group(2))) <= _GIB_ROUNDING
        and abs(report.kv_to_gpu_bytes - _gib(to_gpu.group(2))) <= _GIB_ROUNDING
    )
    return report if plausible else Unparsed(WORKER_MEMORY_REPORT, text)


def recognise_graph_pool(line: str) -> CudaGraphPool | Unparsed | None:
    if _GRAPH_POOL_MARKER not in line:
        return None
    m = _GRAPH_POOL.search(line)
    if m is None or float(m.group(1)) < 0:
        return Unparsed(CUDA_GRAPH_POOL, line.strip())
    estimated = m.group(2)
    return CudaGraphPool(
        text=line.strip(),
        actual_bytes=_gib(m.group(1)),
        estimated_bytes=_gib(estimated) if estimated is not None else None,
    )


def recognise_initial_free(line: str) -> InitialFree | Unparsed | None:
    if _INITIAL_FREE_MARKER not in line:
        return None
    m = _INITIAL_FREE.search(line)
    if m is None:
        return Unparsed(INITIAL_FREE, line.strip())
    return InitialFree(text=line.strip(), free_bytes=_gib(m.group(1)), reserved_bytes=_gib(m.group(2)))


def recognise_kv_all(line: str) -> list[KVObservation | KVTooSmall]:
    if "max seq len" in line:
        m = _KV_TOO_SMALL.search(line)
        if m is not None:
            return [
                KVTooSmall(
                    text=line.strip(),
                    max_seq_len=int(m.group(1)),
                    needed_bytes=round(parse_number(m.group(2)) * GIB),
                    available_bytes=round(parse_number(m.group(3)) * GIB),
                )
            ]
        old = _KV_TOO_SMALL_OLD.search(line)
        if old is not None:
            return [
                KVTooSmall(
                    text=line.strip(), max_seq_len=int(old.group(1)), available_tokens=int(old.group(2))
                )
            ]
    if _NO_KV_MEMORY in line:
        return [KVTooSmall(text=line.strip(), available_bytes=0)]
    out: list[KVObservation | KVTooSmall] = []
    if "KV cache" in line:
        m = _AVAILABLE_KV.search(line)
        if m is not None:
            return [KVObservation(AVAILABLE_KV, float(round(parse_number(m.group(1)) * GIB)), line.strip())]
        m = _KV_TOKENS.search(line)
        if m is not None:
            out.append(KVObservation(KV_TOKENS, parse_number(m.group(1)), line.strip()))
    # Not `elif`: since vLLM 0.33 the concurrency follows the size on the same line.
    if "Maximum concurrency" in line:
        m = _MAX_CONC.search(line)
        if m is not None:
            out.append(KVObservation(MAX_CONCURRENCY, parse_number(m.group(2)), line.strip()))
    if not out and "Model loading took" in line:
        m = _MODEL_LOADING.search(line)
        if m is not None:
            out.append(
                KVObservation(MODEL_LOADING, float(round(parse_number(m.group(1)) * GIB)), line.strip())
            )
    return out


def recognise_all(line: str) -> list[Recognised]:
    """Everything this line says that rankguard cares about, in the order it says it; [] is
    the usual case. One line can say two things (vLLM 0.33's KV size and concurrency)."""
    if not any(k in line for k in _KEYWORDS):
        return []
    # First: the reason in a "Disabling the extensible KV cache" line can quote a driver's "out
    # of memory", and the engine falls back then, it does not fail; and before the KV lines,
    # since both speak of "the KV cache".
    extensible = recognise_extensible(line)
    if isinstance(extensible, UnreadLine):
        return [Unparsed(extensible.kind, extensible.text)]
    if extensible is not None:
        return [extensible]
    oom = recognise_oom(line)
    if oom is not None:
        return [oom]
    # Before the KV lines: the report mentions "kv cache memory", and "Free memory on device".
    for one in (recognise_worker_report, recognise_graph_pool, recognise_initial_free):
        found = one(line)
        if found is not None:
            return [found]
    return list(recognise_kv_all(line))


def recognise(line: str) -> Recognised | None:
    """The first thing this line says that rankguard cares about, or None (the usual case)."""
    found = recognise_all(line)
    return found[0] if found else None
