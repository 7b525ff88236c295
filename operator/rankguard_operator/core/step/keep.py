"""The pass keeps the workload as rendered: the Deployment (or a multi-node service's groups,
moved one pass at a time by core/step/group_roll, or its LeaderWorkerSet), and the Service.

Server-side apply is idempotent; an apply is skipped when the live template already carries
what the pass would render. A service that changed shape drops what the old shape applied.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.effects import ApplyObject, ApplyService, DeleteObject, Effect
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.groups import Groups
from rankguard_operator.core.observe.pods import RolloutState, deployment_template_hash, rollout_state
from rankguard_operator.core.render.deployment import render_service
from rankguard_operator.core.render.group import render_group_service
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import group_roll
from rankguard_operator.core.step.rendering import Live, Renderer, apply
from rankguard_operator.core.step.world import World, same_template


@dataclass(frozen=True)
class Kept:
    live: Live
    effects: tuple[Effect, ...]
    rollout: RolloutState  # of the template the pass wants
    members: dict[str, Any] | None = None  # status.groups, when multi-node
    workload_hash: str | None = None  # status.workloadHash, when a LeaderWorkerSet was applied


def keep(
    state: ServiceState,
    world: World,
    *,
    renderer: Renderer,
    current: ServingFlags,
    live: Live,
    groups: Groups | None,
    first_pass: bool,
) -> Kept:
    spec = renderer.spec
    want = renderer.render(current)
    effects: list[Effect] = []
    if not same_template(live.deployment, want, spec.replicas):
        live, applied = apply(live, want)
        effects += applied
    members, workload_hash = None, None
    if groups is not None:
        rolled, members, workload_hash = _roll_groups(state, world, want, live, groups)
        effects += rolled
    elif world.statefulsets:
        # the service stopped being multi-node: its groups go (the Deployment replaces them)
        effects += [
            DeleteObject("StatefulSet", str(s["metadata"]["name"]), world.namespace)
            for s in world.statefulsets
        ]
    if first_pass or world.generation != state.observed_generation:
        effects.append(ApplyService(render_service(world.name, world.namespace, world.uid, spec)))
        if spec.distributed is not None and spec.distributed.workload == "StatefulSet":
            effects.append(ApplyObject(render_group_service(world.name, world.namespace, world.uid)))
    rollout = rollout_state(live.deployment, deployment_template_hash(want) or "")
    return Kept(live, tuple(effects), rollout, members, workload_hash)


def _roll_groups(
    state: ServiceState, world: World, want: Mapping[str, Any], live: Live, groups: Groups
) -> tuple[list[Effect], dict[str, Any] | None, str | None]:
    """Move the groups one pass toward `want` (core/step/group_roll); drop the single-pod
    Deployment of a service that became multi-node. (effects, status.groups, workloadHash)"""
    effects: list[Effect] = []
    if world.deployment is not None:
        effects.append(DeleteObject("Deployment", world.name, world.namespace))
    lws = want.get("leaderWorkerSet")
    if lws is not None:
        # LWS's controller rolls and restarts the groups; rankguard applies when its render changed
        digest = deployment_template_hash(want)
        if state.raw.get("workloadHash") != digest or live.roll_annotations:
            return [*effects, ApplyObject(lws)], None, digest
        return effects, None, None
    recorded = state.raw.get("groups")
    annotated = {**want, "metadata": {**want["metadata"], "annotations": dict(live.roll_annotations)}}
    plan = group_roll.plan_roll(
        annotated, groups, recorded if isinstance(recorded, dict) else {}, namespace=world.namespace
    )
    return [*effects, *plan.effects], plan.members, None
