"""The MemoryCreep condition and its Event: the tightest rank's headroom falling for hours while
serving (core/observe/memory_trend), said on the object and never acted on. No rule of the
policy reads it, and it does not make the service Degraded: a trend is not a failure, and a
restart for one would cost the replicas' work in progress on a guess.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_operator.core.conditions import Condition, condition
from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.observe.memory_trend import (
    CREEP_FALL_FRACTION_PER_HOUR,
    CREEP_HORIZON_HOURS,
    MemoryTrend,
    creeping,
)
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.units import format_bytes

CREEP_FALLING = "HeadroomFalling"


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def memory_creep_condition(
    trend: MemoryTrend | None, spec: ServiceSpec, old: Sequence[Mapping[str, Any]]
) -> tuple[str, str, str]:
    """(status, reason, message) of the MemoryCreep condition, from the series alone (so it
    changes only when the series does). True while the tightest rank's headroom falls fast
    enough to reach spec.memory.minHeadroomBytes within hours; the policy never reads it."""
    line = spec.memory.min_headroom_bytes
    if trend is None or not trend.samples:
        return (
            "False",
            "NotServing",
            "no headroom figures from the serving pods since they started: the trend starts with the first",
        )
    f = trend.fitted
    if f is None:
        return (
            "False",
            "CollectingSamples",
            f"{len(trend.samples)} sample(s) of the tightest rank's headroom over "
            f"{_duration(trend.samples[-1][0] - trend.samples[0][0])}; the trend is judged after an hour",
        )
    prev = condition(old, Condition.MEMORY_CREEP) or {}
    was = prev.get("status") == "True" and prev.get("reason") == CREEP_FALLING
    who = "the tightest rank" if f.rank is None else f"rank {f.rank}"
    rate = f"{format_bytes(round(abs(f.bytes_per_hour)))}/h"
    over = f"least squares over {f.samples} samples in {_duration(f.span_seconds)}"
    hours = f.hours_to(line)
    where = f"the low-headroom line ({format_bytes(line)}, spec.memory.minHeadroomBytes)"
    if creeping(f, line, was=was):
        when = "has already reached " + where if hours == 0 else f"reaches {where} in about {hours:.1f} h"
        return (
            "True",
            CREEP_FALLING,
            f"{who}'s free GPU memory is falling {rate} ({over}); at this rate it {when}, where "
            "rankguard shrinks the KV budget. rankguard restarts nothing for a trend: find what "
            "grows (nvidia-smi in the pod lists each process's GPU memory), or restart the pods "
            "in a quiet hour (kubectl rollout restart) to start their memory over.",
        )
    gpu = f.gpu_bytes or 0
    steep = f.bytes_per_hour <= -CREEP_FALL_FRACTION_PER_HOUR * gpu
    if f.bytes_per_hour >= 0:
        why = "not falling"
    elif steep and f.a_step:
        why = "one step down (one half of the samples holds the fall), not a steady fall"
    elif hours is not None and steep:
        why = f"at this rate {where} is {hours:.0f} h away, beyond {CREEP_HORIZON_HOURS:g} h"
    else:
        limit = format_bytes(round(CREEP_FALL_FRACTION_PER_HOUR * gpu))
        why = f"not falling faster than {CREEP_FALL_FRACTION_PER_HOUR:.0%} of the GPU ({limit}) an hour"
    verb = "rising" if f.bytes_per_hour >= 0 else "falling"
    return "False", "HeadroomSteady", f"{who}'s free GPU memory is {verb} {rate} ({over}): {why}"


def creep_event(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> PostEvent | None:
    """One Warning Event when MemoryCreep turns True (not again while it lasts)."""
    after = condition(new, Condition.MEMORY_CREEP) or {}
    before = condition(old, Condition.MEMORY_CREEP) or {}
    if after.get("status") != "True" or before.get("status") == "True":
        return None
    return PostEvent("Warning", "MemoryCreep", str(after.get("message") or ""), repeat=True)
