"""Passes that apply nothing and say why: a spec rankguard cannot serve (or a refusal of the
surroundings: a name or a cache claim another LLMService holds), and an object the API server
refused to take.

Pure: no I/O, no clock (`world.now`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_operator.core.conditions import Condition, Phase, set_condition
from rankguard_operator.core.effects import Effect, PostEvent, WriteStatus
from rankguard_operator.core.observe.groups import live_groups
from rankguard_operator.core.status.degraded import said_before
from rankguard_operator.core.status.patch import merged_status, status_patch
from rankguard_operator.core.status.scale import scale_status, spec_key
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
    new = {
        "phase": Phase.FAILED.value,
        "observedGeneration": world.generation,
        "conditions": conditions,
        "specKey": spec_key(world.spec),
        **_scale(world),
    }
    effects: list[Effect] = list(scaled)
    if not said_before(state.raw.get("conditions") or [], reason, message):
        effects.append(PostEvent("Warning", reason, message, repeat=True))  # once per change
    patch = status_patch(state.raw, new)
    if patch is not None:
        effects.append(WriteStatus(patch))
    next_state = ServiceState.from_status(merged_status(state.raw, new))
    return Step(next_state, tuple(effects), None, Phase.FAILED.value, busy=busy(state, world), before=state)


def _scale(world: World) -> dict[str, Any]:
    """status.replicas and status.selector while the spec is refused: an HPA needs the selector
    whatever the spec says. Read from the spec as stored (it may not parse) and the workload as
    it stands; a multi-node service's groups count while any pod of theirs is left (a group
    core/step/scale_down set to zero counts once its pods are gone, as a Deployment's do)."""
    multi_node = isinstance(world.spec.get("distributed"), Mapping)
    workload = world.deployment
    if multi_node:
        # a group's size does not change whether it is empty: 1 stands for it
        groups = live_groups(world.statefulsets, world.pods, 1).by_index.values()
        workload = {"status": {"replicas": sum(1 for g in groups if not g.empty)}}
    return scale_status(world.name, multi_node=multi_node, workload=workload)


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
