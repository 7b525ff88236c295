"""The pass keeps the workload as rendered: the Deployment (or a multi-node service's groups,
moved one pass at a time by core/step/group_roll, or its LeaderWorkerSet), and the Service.

Server-side apply is idempotent; an apply is skipped when the live template already carries
what the pass would render. A LeaderWorkerSet is applied when its render changed, and whenever
the edge read none (deleted by hand, or never created: an LWS CRD not installed makes the apply
fail, which the edge says on the LLMService).

A service that changed shape (one pod, StatefulSet groups, a LeaderWorkerSet) deletes what the
old shape applied, and in the same pass before the new shape's applies: a full cluster schedules
the new shape's pods only once the old ones have freed their GPUs, so the two never run side by
side longer than a roll's own overlap, and nothing of the old shape is left running. Only
objects this LLMService controls (by UID) are deleted; the edge checks the live object again
before each delete.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.effects import ApplyObject, ApplyService, DeleteObject, Effect
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import LWS_KIND, OWNER_KIND, group_service_name
from rankguard_operator.core.observe.groups import Groups
from rankguard_operator.core.observe.ownership import controller_of
from rankguard_operator.core.observe.pods import RolloutState, deployment_template_hash, rollout_state
from rankguard_operator.core.render.deployment import render_service
from rankguard_operator.core.render.group import render_group_service
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import group_roll
from rankguard_operator.core.step.rendering import Live, Renderer, apply
from rankguard_operator.core.step.world import World, same_template

# spec.distributed.workload's shapes, and a one-pod service's
DEPLOYMENT, STATEFULSET, LWS = "Deployment", "StatefulSet", LWS_KIND


@dataclass(frozen=True)
class Kept:
    live: Live
    effects: tuple[Effect, ...]
    rollout: RolloutState  # of the template the pass wants
    members: dict[str, Any] | None = None  # status.groups, when multi-node
    workload_hash: str | None = None  # status.workloadHash, when a LeaderWorkerSet was applied
    forget_workload: bool = False  # status.workloadHash cleared: the LeaderWorkerSet is gone
    # the pass changes the template (False), only the count of replicas (True: a scale), or neither
    scaling: bool | None = None


def shape(spec: ServiceSpec) -> str:
    """The workload a spec runs on: a Deployment, StatefulSet groups or a LeaderWorkerSet."""
    return DEPLOYMENT if spec.distributed is None else spec.distributed.workload


def reads_leader_worker_set(spec: Mapping[str, Any], state: ServiceState) -> bool:
    """Whether the edge reads the service's LeaderWorkerSet this pass (World.leader_worker_set):
    while the spec asks for one (to re-apply one that is gone), and while status says one was
    applied (to delete it once the spec asks for another shape). From the spec as stored: the
    edge reads before the step parses."""
    distributed = spec.get("distributed")
    wants = isinstance(distributed, Mapping) and distributed.get("workload") == LWS
    return wants or bool(state.raw.get("workloadHash"))


def keep(
    state: ServiceState,
    world: World,
    *,
    renderer: Renderer,
    current: ServingFlags,
    live: Live,
    groups: Groups | None,
    first_pass: bool,
    scaled: bool,
) -> Kept:
    """`scaled`: this generation changed spec.replicas alone (core/status/scale.scaled_only)."""
    spec = renderer.spec
    want = renderer.render(current)
    scaling = _scaling(live.deployment, want, groups, spec.replicas)
    # a scale (spec.replicas alone: core/status/scale) changes nothing the Service is made of
    spec_changed = first_pass or (world.generation != state.observed_generation and not scaled)
    # a new service has no old shape; an edited one may have had one
    effects: list[Effect] = _old_shape(world, shape(spec), edited=spec_changed and not first_pass)
    if not same_template(live.deployment, want, spec.replicas):
        live, applied = apply(live, want)
        effects += applied
    members, workload_hash = None, None
    if groups is not None:
        rolled, members, workload_hash = _roll_groups(state, world, want, live, groups)
        effects += rolled
    if spec_changed:
        effects.append(ApplyService(render_service(world.name, world.namespace, world.uid, spec)))
        if shape(spec) == STATEFULSET:
            effects.append(ApplyObject(render_group_service(world.name, world.namespace, world.uid)))
    rollout = rollout_state(live.deployment, deployment_template_hash(want) or "")
    # a LeaderWorkerSet recorded but no longer wanted, and gone: nothing left to look for
    forget = shape(spec) != LWS and world.leader_worker_set is None and bool(state.raw.get("workloadHash"))
    return Kept(live, tuple(effects), rollout, members, workload_hash, forget, scaling)


def _scaling(
    live: Mapping[str, Any] | None, want: Mapping[str, Any], groups: Groups | None, replicas: int
) -> bool | None:
    """Whether the pass's render moves the workload's template (False), only its count of
    replicas (True: a scaler's change, or a count changed by hand and put back), or neither
    (None). A multi-node service's count is its groups, each group's template its own."""
    digest = deployment_template_hash(want)
    if groups is not None:
        hashes = {g.template_hash for g in groups.by_index.values()} - {None}
        if hashes != {digest}:
            return False  # another template, or none yet: a roll or the first start
        return True if set(groups.by_index) != set(range(replicas)) else None
    if live is None:
        return False
    if deployment_template_hash(live) != digest:
        return False
    return True if (live.get("spec") or {}).get("replicas") != replicas else None


def _ours(obj: Mapping[str, Any] | None, uid: str) -> bool:
    return obj is not None and bool(uid) and controller_of(obj) == (OWNER_KIND, uid)


def _old_shape(world: World, wanted: str, *, edited: bool) -> list[Effect]:
    """The deletes of what another shape than `wanted` applied and this service controls."""
    ns, out = world.namespace, list[Effect]()
    if wanted != DEPLOYMENT and _ours(world.deployment, world.uid):
        out.append(DeleteObject("Deployment", world.name, ns))
    if wanted != STATEFULSET:
        # the groups' sets (their pods go with them); never a set another controller made
        out += [
            DeleteObject("StatefulSet", str(s["metadata"]["name"]), ns)
            for s in world.statefulsets
            if _ours(s, world.uid)
        ]
        if edited:
            # the headless Service is not watched: looked for when the spec changed (the edge
            # reads it and deletes it only when this service controls it; none is fine)
            out.append(DeleteObject("Service", group_service_name(world.name), ns))
    lws = world.leader_worker_set
    if wanted != LWS and lws is not None and _ours(lws, world.uid):
        out.append(DeleteObject(LWS_KIND, str(lws["metadata"]["name"]), ns))
    return out


def _roll_groups(
    state: ServiceState, world: World, want: Mapping[str, Any], live: Live, groups: Groups
) -> tuple[list[Effect], dict[str, Any] | None, str | None]:
    """Move the groups one pass toward `want` (core/step/group_roll). (effects, status.groups,
    workloadHash)"""
    lws = want.get("leaderWorkerSet")
    if lws is not None:
        # LWS's controller rolls and restarts the groups; rankguard applies when its render
        # changed, for a remediation, when the edge saw none (deleted by hand, or not created),
        # and when its count of groups is not the spec's (a scale, which the hash leaves out)
        digest = deployment_template_hash(want)
        gone = world.leader_worker_set is None
        count = ((world.leader_worker_set or {}).get("spec") or {}).get("replicas")
        rescaled = not gone and count != (lws.get("spec") or {}).get("replicas")
        if state.raw.get("workloadHash") != digest or live.roll_annotations or gone or rescaled:
            return [ApplyObject(lws)], None, digest
        return [], None, None
    recorded = state.raw.get("groups")
    annotated = {**want, "metadata": {**want["metadata"], "annotations": dict(live.roll_annotations)}}
    plan = group_roll.plan_roll(
        annotated, groups, recorded if isinstance(recorded, dict) else {}, namespace=world.namespace
    )
    return plan.effects, plan.members, None
