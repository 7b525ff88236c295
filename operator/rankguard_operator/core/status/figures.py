"""What an SRE watches of one LLMService, read from the status a step leaves: the figures the
operator exports as metrics, the memory terminations it counts, and the one log line when the
phase changes.

Everything here reads the status as written (one source for `kubectl get`, Events and
metrics), so the metrics never say something the object does not.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.conditions import Condition, Phase
from rankguard_operator.core.observe.pods import CUDA_OOM, OOM_KILLED, Termination
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.capacity import model_name

# A run that ran out of memory (the GPU's, the container's): rankguard_operator_ooms_observed_total.
# Not KVCacheTooSmall: that is vLLM refusing to start, before any memory ran out.
OOM_KINDS = (CUDA_OOM, OOM_KILLED)
PHASES = tuple(p.value for p in Phase)
UNKNOWN_RANK = "unknown"
# the condition that explains each phase, for the phase-change log line
_WHY = {
    Phase.FAILED.value: Condition.DEGRADED.value,
    Phase.DEGRADED.value: Condition.DEGRADED.value,
    Phase.REMEDIATING.value: Condition.REMEDIATING.value,
    Phase.RUNNING.value: Condition.READY.value,
    Phase.DEPLOYING.value: Condition.PROGRESSING.value,
    Phase.PENDING.value: Condition.READY.value,
}


@dataclass(frozen=True)
class Figures:
    """One service's gauges. None (or empty) is "not known": the series is left out."""

    phase: str
    kv_budget_bytes: int | None = None
    rank_headroom: tuple[tuple[int, int], ...] = ()  # (rank, headroom bytes), fresh ranks only
    headroom_target_bytes: int | None = None
    conditions: tuple[tuple[str, str, str], ...] = ()  # (type, status, reason)
    # status.memoryTrend's fit (core/observe/memory_trend), once it spans an hour of serving:
    # the tightest rank's headroom slope, and the hours until it reaches minHeadroomBytes at that
    # slope (None while not falling; 0 once there)
    headroom_trend_bytes_per_hour: int | None = None
    headroom_exhaustion_hours: float | None = None
    # status.capacity (core/status/capacity): the KV tokens one replica holds, the requests of
    # max_model_len it serves at once, and the `model_name` label vLLM's own metrics carry
    kv_capacity_tokens: int | None = None
    kv_max_concurrency: float | None = None
    model_name: str | None = None

    @property
    def min_headroom_bytes(self) -> int | None:
        return min((h for _, h in self.rank_headroom), default=None)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def figures(status: Mapping[str, Any], spec: ServiceSpec | None) -> Figures:
    """The gauges of a service from its status (as a step leaves it) and its spec as the step
    parsed it (None when it was refused)."""
    budget = status.get("budget")
    budget = budget if isinstance(budget, Mapping) else {}
    ranks = []
    for row in status.get("ranks") or []:
        if isinstance(row, Mapping) and not row.get("stale"):
            rank, headroom = _int(row.get("rank")), _int(row.get("headroomBytes"))
            if rank is not None and headroom is not None:
                ranks.append((rank, headroom))
    trend = status.get("memoryTrend")
    trend = trend if isinstance(trend, Mapping) else {}
    hours = trend.get("hoursToLine")
    conditions = tuple(
        (str(c.get("type")), str(c.get("status") or "Unknown"), str(c.get("reason") or ""))
        for c in status.get("conditions") or []
        if isinstance(c, Mapping) and c.get("type")
    )
    capacity = status.get("capacity")
    capacity = capacity if isinstance(capacity, Mapping) else {}
    name = capacity.get("modelName")
    return Figures(
        phase=str(status.get("phase") or Phase.PENDING.value),
        kv_budget_bytes=_int(budget.get("kvCacheMemoryBytes")),
        rank_headroom=tuple(sorted(ranks)),
        headroom_target_bytes=None if spec is None else spec.memory.min_headroom_bytes,
        conditions=conditions,
        headroom_trend_bytes_per_hour=_int(trend.get("bytesPerHour")),
        headroom_exhaustion_hours=float(hours)
        if isinstance(hours, (int, float)) and not isinstance(hours, bool) and hours >= 0
        else None,
        kv_capacity_tokens=_int(capacity.get("tokens")),
        kv_max_concurrency=_number(capacity.get("maxConcurrency")),
        model_name=name if isinstance(name, str) and name else None if spec is None else model_name(spec),
    )


def memory_terminations(seen: Sequence[Termination]) -> list[Termination]:
    """The runs of vLLM among `seen` that ended for memory (a CUDA OOM, the kernel's OOM kill),
    acted upon or not."""
    return [t for t in seen if t.kind in OOM_KINDS]


def rank_label(t: Termination) -> str:
    return UNKNOWN_RANK if t.rank is None else str(t.rank)


def phase_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """One sentence when the phase changed ("Running -> Degraded: OOMAtFloor: …"), else None."""
    before, after = str(old.get("phase") or ""), str(new.get("phase") or "")
    if not after or before == after:
        return None
    why = _WHY.get(after)
    cond = next(
        (c for c in new.get("conditions") or [] if isinstance(c, Mapping) and c.get("type") == why), None
    )
    text = f"phase {before or 'none'} -> {after}"
    if cond is not None:
        reason, message = str(cond.get("reason") or ""), str(cond.get("message") or "")
        text += f" ({reason}: {message})" if message else f" ({reason})"
    return text
