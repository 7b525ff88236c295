"""An LLMService's Conditions and phase: the names (one enum each), setting a condition the
Kubernetes way, and the one-word phase the PHASE column shows.

Pure: no I/O, no clock (times come in as arguments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any


class Condition(str, Enum):
    """The condition types rankguard sets on an LLMService."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    REMEDIATING = "Remediating"
    BUDGET_PLANNED = "BudgetPlanned"
    ENGINE_RULES = "EngineRules"  # which recorded vLLM snapshot's rules apply (core/status/engine)
    MODEL_RESOLVED = "ModelResolved"  # where the shape came from, or why measure-first (core/model/resolve)
    MODEL_CACHE_READY = "ModelCacheReady"  # spec.modelCache's claim is bound (core/render/claim)
    AGENT_READY = "AgentReady"  # every ready serving pod's agent reports (core/observe/agent_ready)
    # the tightest rank's headroom falling for hours while serving (core/observe/memory_trend); said,
    # never acted on: no rule of the policy reads it, and it does not make the service Degraded
    MEMORY_CREEP = "MemoryCreep"


class Phase(str, Enum):
    """The CRD's status.phase."""

    PENDING = "Pending"
    DEPLOYING = "Deploying"
    RUNNING = "Running"
    REMEDIATING = "Remediating"
    DEGRADED = "Degraded"
    FAILED = "Failed"


def set_condition(  # noqa: PLR0917 - the condition's fields, positionally, as callers read them
    conditions: Sequence[Mapping[str, Any]],
    type: Condition | str,
    status: str,
    reason: str,
    message: str,
    now_iso: str,
    observed_generation: int,
) -> list[dict[str, Any]]:
    """A copy of `conditions` with `type` set. lastTransitionTime moves only when the status
    changes (the Kubernetes convention); reason, message and generation are always updated."""
    type = _name(type)
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions:
        if c.get("type") != type:
            out.append(dict(c))
            continue
        found = True
        changed = c.get("status") != status
        out.append(
            {
                "type": type,
                "status": status,
                "reason": reason,
                "message": message[:32768],
                "lastTransitionTime": now_iso if changed else c.get("lastTransitionTime", now_iso),
                "observedGeneration": observed_generation,
            }
        )
    if not found:
        out.append(
            {
                "type": type,
                "status": status,
                "reason": reason,
                "message": message[:32768],
                "lastTransitionTime": now_iso,
                "observedGeneration": observed_generation,
            }
        )
    return out


def drop_condition(conditions: Sequence[Mapping[str, Any]], type: Condition | str) -> list[dict[str, Any]]:
    """A copy of `conditions` without `type` (a condition about something no longer configured)."""
    name = _name(type)
    return [dict(c) for c in conditions if c.get("type") != name]


def _name(type: Condition | str) -> str:
    return type.value if isinstance(type, Condition) else type


def condition(conditions: Sequence[Mapping[str, Any]], type: Condition | str) -> Mapping[str, Any] | None:
    name = _name(type)
    for c in conditions:
        if c.get("type") == name:
            return c
    return None


def is_true(conditions: Sequence[Mapping[str, Any]], type: Condition | str) -> bool:
    c = condition(conditions, type)
    return c is not None and c.get("status") == "True"


def phase_for(conditions: Sequence[Mapping[str, Any]], *, failed: bool = False) -> Phase:
    """The one-word phase from the conditions: Failed (the spec cannot be served), Degraded,
    Remediating, Running (Ready), Deploying (a rollout in progress), else Pending."""
    if failed:
        return Phase.FAILED
    if is_true(conditions, Condition.DEGRADED):
        return Phase.DEGRADED
    if is_true(conditions, Condition.REMEDIATING):
        return Phase.REMEDIATING
    if is_true(conditions, Condition.READY):
        return Phase.RUNNING
    if is_true(conditions, Condition.PROGRESSING):
        return Phase.DEPLOYING
    return Phase.PENDING
