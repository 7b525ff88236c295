"""The `/report` document's memory fields beyond the GPU's own figures (issue 49).

vLLM 0.34's extensible KV cache sizes itself from the memory it measures after warm-up on every
rank; what it cannot see is memory other processes hold on the same GPU (or take later). So the
agent reports, per rank,

- `others_bytes`: memory on the rank's GPU held by processes that are not this pod's (neither the
  agent nor the engine's process tree); None = unknown;
- `others_peak_bytes`: the most `others_bytes` has been since the agent started;
- `others`: the largest of them that the agent can name, at most `MAX_OTHERS` `OtherProcess`es;
- `warmup`: that rank's own "Memory after warmup" line (`WarmupMemory`);
- `free_at_load_bytes` and `others_at_load_bytes`: the GPU's free memory, and `others_bytes`,
  when this rank's worker began loading weights in the current engine run. vLLM 0.34 commits
  min(requested − non_kv_used, headroom − margin) − transient, where non_kv_used counts only
  what the engine allocated since its worker's init memory snapshot (`init_snapshot`, taken in
  `init_device` after the CUDA context and NCCL, before `load_model`), which vLLM does not print:
  the free memory at the load's start is that snapshot's free memory (to within what the worker
  allocated in between), so the operator can tell at which utilisation its reserve binds;

and, for the pod: `vmm` (the node's driver supports GPU virtual memory management, which the
extensible KV cache needs), `imex_channel` (an IMEX channel opens in this pod, which FABRIC
handles need) and `extensible_disabled` (the reason the engine printed when it turned the
extensible KV cache off).

All of them are advisory, like the engine fields of `report.py`: `parse_rank_memory` and
`parse_pod_memory` drop a malformed one alone and name it in `dropped` ("where: why"), and a
report without them (an older agent's) parses with their defaults. Standard library only: the
operator imports this module too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

T = TypeVar("T")

MAX_OTHERS = 4  # the largest few neighbours are enough to name; their sum is `others_bytes`
MAX_PROCESS_NAME = 64  # /proc/<pid>/comm is at most 15 characters; "pid N" is shorter still
MAX_PID = (1 << 22) - 1  # Linux's pid_max ceiling (PID_MAX_LIMIT on 64-bit)
MAX_BLOCKS = 1 << 40  # far beyond any KV cache's block count
MAX_REASON = 1024  # as report.MAX_TEXT
_MAX_BYTES = 1 << 50  # as report.MAX_BYTES: the largest believable GPU memory figure


class MemoryFieldError(ValueError):
    """One memory field is malformed. The message says where and why."""


@dataclass(frozen=True)
class OtherProcess:
    """A process of another pod (or of nobody's) holding memory on the rank's GPU."""

    pid: int  # as the agent's pid namespace sees it
    name: str  # /proc/<pid>/comm where the agent can read it, else "pid N"
    bytes: int


@dataclass(frozen=True)
class WarmupMemory:
    """A rank's "Memory after warmup: ..." line (vLLM 0.34, `measure_kv_cache_blocks` in
    vllm/v1/worker/extensible_kv_cache.py). Every figure but `blocks` is printed in GiB with
    2 decimals (0.01 GiB precise)."""

    free_bytes: int  # free on the device after warm-up and CUDA graph capture
    committed_bytes: int  # physically committed to the KV cache by then
    kept_bytes: int  # kept free for transient activations: max(peak, torch growth)
    peak_bytes: int  # allocated at the transient peak
    torch_growth_bytes: int  # the largest growth of torch's reservation over a sizing step
    blocks: int  # KV cache blocks this rank can hold (the engine takes the least over ranks)
    blocks_bytes: int  # what those blocks take
    requested_bytes: int  # total × gpu_memory_utilization
    torch_cap_bytes: int  # the cap vLLM sets on torch's caching allocator


_WARMUP_FIELDS = tuple(f.name for f in fields(WarmupMemory))


def _is_int(v: Any) -> bool:
    # bool is an int in Python; a report saying `true` bytes is broken.
    return isinstance(v, int) and not isinstance(v, bool)


def _figure(v: Any, where: str, hi: int = _MAX_BYTES, lo: int = 0) -> int:
    if not _is_int(v):
        raise MemoryFieldError(f"{where}: expected an integer, got {v!r:.40}")
    if not lo <= v <= hi:
        raise MemoryFieldError(f"{where}: {v} is outside [{lo}, {hi}]")
    return int(v)


def _opt_figure(doc: dict[str, Any], key: str, where: str) -> int | None:
    v = doc.get(key)
    return None if v is None else _figure(v, f"{where}.{key}")


def _other(doc: Any, where: str) -> OtherProcess:
    if not isinstance(doc, dict):
        raise MemoryFieldError(f"{where}: expected an object, got {type(doc).__name__}")
    name = doc.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_PROCESS_NAME:
        raise MemoryFieldError(f"{where}.name: expected a process name, got {name!r:.40}")
    return OtherProcess(
        pid=_figure(doc.get("pid"), f"{where}.pid", MAX_PID, 1),
        name=name,
        bytes=_figure(doc.get("bytes"), f"{where}.bytes"),
    )


def _others(doc: Any, where: str, total: int | None) -> list[OtherProcess]:
    if doc is None:
        return []
    if not isinstance(doc, list) or len(doc) > MAX_OTHERS:
        raise MemoryFieldError(f"{where}: expected a list of at most {MAX_OTHERS} processes")
    found = [_other(p, f"{where}[{i}]") for i, p in enumerate(doc)]
    if len({p.pid for p in found}) != len(found):
        raise MemoryFieldError(f"{where}: a process is listed twice")
    # The named ones are part of what `others_bytes` counts (which adds what no process names).
    if total is not None and sum(p.bytes for p in found) > total:
        raise MemoryFieldError(f"{where}: the processes hold more than others_bytes ({total})")
    return found


def warmup_memory(doc: Any, where: str) -> WarmupMemory | None:
    """A rank's `warmup` field; MemoryFieldError when it is not one."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise MemoryFieldError(f"{where}: expected an object, got {type(doc).__name__}")
    figures = {
        k: _figure(doc.get(k), f"{where}.{k}", MAX_BLOCKS if k == "blocks" else _MAX_BYTES)
        for k in _WARMUP_FIELDS
    }
    return WarmupMemory(**figures)


@dataclass(frozen=True)
class RankMemory:
    """What `parse_rank_memory` read: the RankSample fields of this module."""

    others_bytes: int | None = None
    others_peak_bytes: int | None = None
    others: list[OtherProcess] | None = None
    warmup: WarmupMemory | None = None
    free_at_load_bytes: int | None = None
    others_at_load_bytes: int | None = None


def _at_load(d: dict[str, Any], key: str, where: str) -> int | None:
    """`free_at_load_bytes` or `others_at_load_bytes`: a figure no larger than the GPU (when the
    rank's `total_bytes` is a number: a malformed total rejects the report itself)."""
    v = _opt_figure(d, key, where)
    total = d.get("total_bytes")
    if v is not None and isinstance(total, int) and _is_int(total) and v > total:
        raise MemoryFieldError(f"{where}.{key}: {v} exceeds total_bytes ({total})")
    return v


def parse_rank_memory(d: dict[str, Any], where: str, dropped: list[str]) -> RankMemory:
    """The memory fields of one rank's object `d` (at `where`); each malformed one is dropped
    alone (None, or [] for `others`) and named in `dropped`."""

    def attempt(read: Callable[[], T]) -> T | None:
        try:
            return read()
        except MemoryFieldError as e:
            dropped.append(str(e))
            return None

    current = attempt(lambda: _opt_figure(d, "others_bytes", where))
    peak = attempt(lambda: _opt_figure(d, "others_peak_bytes", where))
    if peak is not None and current is not None and peak < current:
        dropped.append(f"{where}.others_peak_bytes: {peak} is below others_bytes ({current})")
        peak = None
    return RankMemory(
        others_bytes=current,
        others_peak_bytes=peak,
        others=attempt(lambda: _others(d.get("others"), f"{where}.others", current)),
        warmup=attempt(lambda: warmup_memory(d.get("warmup"), f"{where}.warmup")),
        free_at_load_bytes=attempt(lambda: _at_load(d, "free_at_load_bytes", where)),
        others_at_load_bytes=attempt(lambda: _at_load(d, "others_at_load_bytes", where)),
    )


@dataclass(frozen=True)
class PodMemory:
    """What `parse_pod_memory` read: the Report fields of this module."""

    vmm: bool | None = None
    imex_channel: bool | None = None
    extensible_disabled: str | None = None


def _flag(d: dict[str, Any], key: str, dropped: list[str]) -> bool | None:
    v = d.get(key)
    if v is None or isinstance(v, bool):
        return v
    dropped.append(f"report.{key}: expected true, false or null, got {v!r:.40}")
    return None


def parse_pod_memory(d: dict[str, Any], dropped: list[str]) -> PodMemory:
    """The report's pod-wide memory fields; each malformed one is dropped alone (None)."""
    reason = d.get("extensible_disabled")
    if reason is not None and (not isinstance(reason, str) or not 0 < len(reason) <= MAX_REASON):
        dropped.append(f"report.extensible_disabled: expected a reason, got {reason!r:.40}")
        reason = None
    return PodMemory(
        vmm=_flag(d, "vmm", dropped),
        imex_channel=_flag(d, "imex_channel", dropped),
        extensible_disabled=reason,
    )
