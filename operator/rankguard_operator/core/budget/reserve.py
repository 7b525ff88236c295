"""The reserve rankguard renders for an engine that measures its own KV cache (vLLM 0.34).

Such an engine asks for `requested = total × --gpu-memory-utilization` (1.0 when unset) and
commits `min(requested − used since its init snapshot, headroom − its margin) − transients`
(vllm/v1/worker/extensible_kv_cache.py measure_kv_cache_bytes). Once the request is the smaller
term, what stays free after the commit is `init_free − requested` plus the transients: the
utilisation sets it exactly, counted from the free memory at the engine's init snapshot (the agent
reads it per rank when the worker starts loading weights: `free_at_load`). It cannot see memory
other processes take later, nor what its KV connector allocates after the measurement, so the
reserve leaves free, on every rank:

    what other processes grew by since that snapshot (their peak − what they held then)
  + an allowance learned after an OOM (a connector's buffers: the deficit and vLLM's margin)
  + rankguard's safety margin

and the tightest rank sets one utilisation for all (every rank gets the same flag). Nothing is
rendered when nothing needs reserving, which is vLLM's best default. Without the snapshot's free
memory (an older agent) the reserve counts from the GPU's total, which binds later: said in the text.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rankguard_operator.core.units import format_bytes

# vLLM multiplies the utilisation by the total and rounds up; four decimals are ~8 MiB on an
# 80 GiB GPU, finer than any reserve rankguard computes
UTILIZATION_STEP = 10_000
# never ask the engine for less than this share of a GPU: a reserve that large is a broken report
MIN_UTILIZATION = 0.05


@dataclass(frozen=True)
class OutsideRank:
    """One rank's GPU as its agent saw it: memory other processes hold (now and at their peak since
    the agent started), the largest of them (for Events), and the free memory and others' memory
    when the engine's worker started loading weights (vLLM's init snapshot; None: not seen)."""

    rank: int
    pod: str
    uuid: str
    total_bytes: int
    others_bytes: int
    others_peak_bytes: int
    biggest: str | None = None  # "pid 4242 (python3) 6.0Gi"
    free_at_load_bytes: int | None = None
    others_at_load_bytes: int | None = None

    @property
    def growth_bytes(self) -> int:
        """What other processes may take beyond what they held at the engine's snapshot (the whole
        peak when that moment was not seen)."""
        if self.others_at_load_bytes is None or self.free_at_load_bytes is None:
            return self.others_peak_bytes
        return max(0, self.others_peak_bytes - self.others_at_load_bytes)


@dataclass(frozen=True)
class Reserve:
    utilization: float | None  # None: render no --gpu-memory-utilization
    reserve_bytes: int  # what the utilisation leaves free on the tightest rank's GPU (0 when none)
    rank: OutsideRank | None  # the tightest rank
    text: str  # for messages: what the reserve holds


def floor_utilization(value: float) -> float:
    return max(MIN_UTILIZATION, min(1.0, math.floor(value * UTILIZATION_STEP) / UTILIZATION_STEP))


def reserve(
    ranks: Sequence[OutsideRank], *, allowance_bytes: int = 0, margin_bytes: int, growth: bool = True
) -> Reserve:
    """The utilisation that leaves every rank's outside growth (with `growth`), the allowance and
    the margin free after vLLM's commit; None when none of them needs room."""
    best: tuple[float, int, OutsideRank] | None = None
    for r in ranks:
        need = (r.growth_bytes if growth else 0) + allowance_bytes
        if r.total_bytes <= 0 or need <= 0:
            continue
        base = r.free_at_load_bytes if r.free_at_load_bytes is not None else r.total_bytes
        util = (base - need - margin_bytes) / r.total_bytes
        if best is None or util < best[0]:
            best = (util, need, r)
    if best is None:
        return Reserve(None, 0, None, "nothing outside the engine needs room on its GPUs")
    util, need, tightest = best
    floored = floor_utilization(util)
    parts = []
    if growth and tightest.growth_bytes:
        grew = f"{format_bytes(tightest.growth_bytes)} other processes grew by since the engine started"
        parts.append(grew + (f" (largest: {tightest.biggest})" if tightest.biggest else ""))
    if allowance_bytes:
        parts.append(f"{format_bytes(allowance_bytes)} learned after an OOM")
    parts.append(f"{format_bytes(margin_bytes)} safety margin")
    counted = (
        f"of the {format_bytes(tightest.free_at_load_bytes)} free when the engine started"
        if tightest.free_at_load_bytes is not None
        else "counted from the GPU's total (the engine's start was not seen)"
    )
    text = (
        f"{format_bytes(need + margin_bytes)} on rank {tightest.rank} (GPU {tightest.uuid} in pod "
        f"{tightest.pod}) {counted}: " + " + ".join(parts)
    )
    left = tightest.total_bytes - math.ceil(tightest.total_bytes * floored)
    return Reserve(floored, left, tightest, text)


def lowered(current: float | None, by_bytes: int, total_bytes: int) -> float:
    """The utilisation `by_bytes` below the one in effect (1.0, vLLM's default, when unset)."""
    base = 1.0 if current is None else current
    return floor_utilization(base - by_bytes / total_bytes)
