"""The pass's last stage: the status it writes (only when something changed, and not while
only the ranks' figures drifted: core/status/hold), the conditions the surroundings settle, one
Event per change of Degraded, MemoryCreep and the model, and the `Step` the edge carries out.

Pure: no I/O, no clock (`world.now`; `world.status_age` for the hold).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core import policy
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.conditions import Condition, condition, set_condition
from rankguard_operator.core.effects import Effect, PostEvent, WriteStatus
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.resolve import LearnedModel, ModelResolution, model_event
from rankguard_operator.core.observe.groups import Groups
from rankguard_operator.core.observe.pods import RolloutState
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.build import build_status
from rankguard_operator.core.status.creep import creep_event
from rankguard_operator.core.status.degraded import degraded_event
from rankguard_operator.core.status.engine import EngineView, engine_status, with_rules_condition
from rankguard_operator.core.status.groups import group_figures
from rankguard_operator.core.status.hold import hold
from rankguard_operator.core.status.patch import merged_status, status_patch
from rankguard_operator.core.status.scale import as_of_scale, scale_status, spec_key
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import surroundings
from rankguard_operator.core.step.observed import Observed
from rankguard_operator.core.step.world import Settings, Step, World, busy
from rankguard_operator.core.units import iso, iso_or_none


@dataclass(frozen=True)
class Findings:
    """Everything the earlier stages found and decided, as the status reports it."""

    spec: ServiceSpec
    model: ModelResolution
    learned: LearnedModel | None
    prior: Plan | None
    plan: Plan | None
    engine: EngineView
    key: str  # the budget key
    decision: policy.Decision
    current: ServingFlags
    history: list[dict[str, Any]]
    handled: tuple[str, ...]
    seen: Observed
    rollout: RolloutState  # of the template the pass wants
    deployment: Mapping[str, Any] | None  # the workload as it stands after the pass's applies
    new_revision: bool  # a new revision starts its own headroom clocks
    updates: Mapping[str, Any]  # status fields set by the stages (gpuMemoryBytes, workloadHash, ...)
    members: Mapping[str, Any] | None = None  # status.groups, when multi-node
    groups: Groups | None = None  # a multi-node service's groups as seen this pass (status.groupFigures)
    scaling: bool | None = None  # the pass moves the template (False), only the replicas (True), or neither
    scaled: bool = False  # this generation changed spec.replicas alone (core/status/scale.scaled_only)


def report(
    state: ServiceState,
    world: World,
    settings: Settings,
    found: Findings,
    *,
    stored: Mapping[str, Any],
    effects: Sequence[Effect],
) -> Step:
    """`stored`: the status as stored at this point of the pass (the intent changes it); the
    patch is computed against it, so it also clears the intent it follows."""
    status = _status(state, world, found)
    events: list[PostEvent] = []
    said = model_event(state.raw.get("model"), found.model)
    if said is not None:
        events.append(PostEvent(*said, repeat=True))
    settled = surroundings.settle(
        status["conditions"],
        world,
        found.spec,
        current_hash=found.seen.current_hash,
        observation=found.seen.observation,
        reported_pods=[r[0] for r in found.seen.reports],
        now_iso=iso(world.now),
        unavailable_after=settings.agent_unavailable_after,
    )
    status["conditions"] = settled.conditions
    events += settled.events
    posted = [e.reason for e in (*effects, *events) if isinstance(e, PostEvent)]
    for event in (
        degraded_event(state.raw.get("conditions") or [], status["conditions"], posted=posted),
        creep_event(state.raw.get("conditions") or [], status["conditions"]),
    ):
        if event is not None:
            events.append(event)
    out: list[Effect] = [*effects, *events]
    patch = status_patch(stored, status)
    # figures that only drifted are written with the next real change (core/status/hold)
    if patch is not None and not hold(state.raw, patch, world.status_age, policy.headroom_lines(found.spec)):
        out.append(WriteStatus(patch))
    return Step(
        ServiceState.from_status(merged_status(stored, status)),
        tuple(out),
        found.decision,
        str(status.get("phase") or ""),
        settled.agents_unavailable,
        pass_again_after=_due_in(world, found),
        spec=found.spec,
        terminations=tuple(found.seen.terminations),
        busy=busy(state, world),
        before=state,
    )


def _clocks(found: Findings) -> tuple[float | None, float | None]:
    """The low- and ample-headroom clocks after the pass: a new revision starts its own."""
    return (None, None) if found.new_revision else (found.seen.low_since, found.seen.ample_since)


def _due_in(world: World, found: Findings) -> float | None:
    """Seconds until a verdict falls due with nothing else changing: the edge passes by then."""
    low, ample = _clocks(found)
    seen = found.seen
    due = (seen.unscheduled.due_in, seen.stuck.due_in, policy.headroom_due_in(low, ample, world.now))
    return min((t for t in due if t is not None), default=None)


def _status(state: ServiceState, world: World, found: Findings) -> dict[str, Any]:
    """Every status field rankguard owns, as this pass leaves them."""
    seen, spec, now = found.seen, found.spec, iso(world.now)
    ready = int(((found.deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    last_known_good = policy.next_last_known_good(
        state.last_known_good,
        found.current,
        spec=spec,
        rollout=found.rollout,
        observation=seen.observation,
        terminations=seen.terminations,
    )
    # a scale (spec.replicas alone) is no edit: what was said of the spec before holds after it
    status = build_status(
        old=as_of_scale(state.raw, world.generation) if found.scaled else state.raw,
        spec=spec,
        generation=world.generation,
        now_iso=now,
        observation=seen.observation,
        flags=found.current,
        last_known_good=last_known_good,
        plan=found.plan,
        prior=found.prior,
        decision=found.decision,
        rollout=found.rollout,
        ready_replicas=ready,
        history=found.history,
        blocker=seen.unscheduled.blocker or seen.stuck.blocker,
        memory_trend=seen.trend,
        groups=None
        if spec.distributed is None
        else group_figures(found.groups, seen.reports, seen.observation, spec.replicas),
        budget_key=found.key,
    )
    status["conditions"] = _scaling(status["conditions"], state, world, found, ready)
    status.update(found.updates)
    if found.members is not None:
        status["groups"] = dict(found.members)
    conditions = with_rules_condition(status["conditions"], found.engine, now, world.generation)
    status["conditions"] = set_condition(
        conditions, Condition.MODEL_RESOLVED, *found.model.condition(), now, world.generation
    )
    status["model"] = found.model.to_status(found.learned)
    # the workload as the pass leaves it: a scaler sees the replicas it asked for once they exist
    status.update(
        scale_status(world.name, multi_node=spec.distributed is not None, workload=found.deployment)
    )
    low, ample = _clocks(found)
    status.update(
        {
            "servingFlags": found.current.to_status(),
            "engine": engine_status(found.engine, found.key),
            "budgetKey": found.key,
            "specKey": spec_key(world.spec),
            "handledTerminations": list(found.handled),
            "lowHeadroomSince": iso_or_none(low),
            "ampleHeadroomSince": iso_or_none(ample),
            "ampleHeadroomLowestBytes": seen.ample_lowest,
            "unschedulableSince": iso_or_none(seen.unscheduled.since),
            "stuckSince": iso_or_none(seen.stuck.since),
            "serviceApplied": True,
        }
    )
    return status


def _scaling(
    conditions: list[dict[str, Any]], state: ServiceState, world: World, found: Findings, ready: int
) -> list[dict[str, Any]]:
    """Progressing says `Scaling`, not `RollingOut`, while the workload only moves its count of
    replicas (a scaler's change): from the pass that applies the count to the template that
    already ran, until the rollout completes, unless a roll comes in between. A scale in the
    middle of a roll leaves it a roll."""
    now = condition(conditions, Condition.PROGRESSING) or {}
    if now.get("status") != "True" or found.new_revision or found.scaling is False:
        return conditions
    was = condition(list(state.raw.get("conditions") or []), Condition.PROGRESSING) or {}
    rolling = was.get("status") == "True" and was.get("reason") != "Scaling"
    if rolling or (found.scaling is None and was.get("reason") != "Scaling"):
        return conditions
    unit = "replicas" if found.spec.distributed is None else "groups"
    message = f"scaling to {found.spec.replicas} {unit}, the pods' template unchanged: {ready} ready"
    return set_condition(
        conditions, Condition.PROGRESSING, "True", "Scaling", message, iso(world.now), world.generation
    )
