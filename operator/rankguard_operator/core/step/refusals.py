"""Passes that apply nothing and say why: a spec rankguard cannot serve (or a refusal of the
surroundings: a name or a cache claim another LLMService holds), and an object the API server
refused to take.

Pure: no I/O, no clock (`world.now`).
"""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.conditions import Condition, Phase, set_condition
from rankguard_operator.core.effects import Effect, PostEvent, WriteStatus
from rankguard_operator.core.status.degraded import said_before
from rankguard_operator.core.status.patch import merged_status, status_patch
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import scale_down
from rankguard_operator.core.step.world import Step, World, busy
from rankguard_operator.core.units import iso


def invalid_spec(
    state: ServiceState,
    world: World,
    message: str,
    reason: str = "InvalidSpec",
    more: Sequence[tuple[Condition, str, str, str]] = (),
    *,
    cannot_run: bool = False,
    stop: bool = False,
) -> Step:
    """A spec rankguard cannot serve (or a refusal of `reason`, setting the conditions in `more`
    too): say why on the object, and touch nothing else but the scale of a workload none of
    whose pods serves nor will (core/step/scale_down: a Failed service holds no GPUs);
    `cannot_run`: the refusal says the deployed render cannot run either (budget.fits); `stop`:
    its own workload goes to zero even while it serves (a name another service holds: its pods
    would answer for that service)."""
    when = iso(world.now)
    scaled, said = scale_down.hold_nothing(
        world.deployment, world.statefulsets, world.uid, world.pods, cannot_run=cannot_run, stop=stop
    )
    message = f"{message.rstrip('.')}. {said}" if said else message
    conditions = list(state.raw.get("conditions") or [])
    for cond, status, why, text in (
        (Condition.DEGRADED, "True", reason, message),
        (Condition.READY, "False", reason, message),
        *more,
    ):
        conditions = set_condition(conditions, cond, status, why, text, when, world.generation)
    new = {"phase": Phase.FAILED.value, "observedGeneration": world.generation, "conditions": conditions}
    effects: list[Effect] = list(scaled)
    if not said_before(state.raw.get("conditions") or [], reason, message):
        effects.append(PostEvent("Warning", reason, message, repeat=True))  # once per change
    patch = status_patch(state.raw, new)
    if patch is not None:
        effects.append(WriteStatus(patch))
    next_state = ServiceState.from_status(merged_status(state.raw, new))
    return Step(next_state, tuple(effects), None, Phase.FAILED.value, busy=busy(state, world), before=state)


def refused_apply(state: ServiceState, world: World, reason: str, message: str) -> tuple[Effect, ...]:
    """The API server refused what the pass rendered: retrying the same object cannot help. Say
    so on the LLMService (Degraded, one Event per reason and period); a pending remediation
    stays written, to be finished once it can."""
    conditions = set_condition(
        list(state.raw.get("conditions") or []),
        Condition.DEGRADED,
        "True",
        reason,
        message,
        iso(world.now),
        world.generation,
    )
    patch = status_patch(state.raw, {"conditions": conditions, "phase": Phase.DEGRADED.value})
    said = PostEvent("Warning", reason, message, repeat=True)
    return (said,) if patch is None else (WriteStatus(patch), said)
