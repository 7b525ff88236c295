"""The pass's observation: which agents speak for the flags in effect, what their reports say,
which vLLM runs ended, where the rollout stands, the headroom clocks, and what keeps pods from
starting.

Only pods of the template in effect speak for the current flags: a report from a pod of an
earlier template describes flags that no longer run.

Pure: no I/O, no clock (`world.now`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core import policy
from rankguard_operator.core.observe import blockers, memory_trend, pod_blockers, pods
from rankguard_operator.core.observe.blockers import Unschedulable
from rankguard_operator.core.observe.headroom import Observation, ReportInput, aggregate
from rankguard_operator.core.observe.memory_trend import MemoryTrend
from rankguard_operator.core.observe.pod_blockers import PodBlockers
from rankguard_operator.core.observe.pods import RolloutState, Termination
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step.world import Settings, World


@dataclass(frozen=True)
class Observed:
    current_hash: str | None  # the pod template of the flags in effect
    reports: list[ReportInput]  # the reports of that template's ready pods
    observation: Observation
    terminations: list[Termination]  # vLLM runs that ended, not handled yet
    rollout: RolloutState | None
    low_since: float | None  # the headroom clocks (core/policy/trackers)
    ample_since: float | None
    ample_lowest: int | None
    trend: MemoryTrend | None  # the tightest rank's headroom over hours (MemoryCreep only)
    unscheduled: Unschedulable
    stuck: PodBlockers


def observe(
    state: ServiceState,
    world: World,
    spec: ServiceSpec,
    settings: Settings,
    *,
    current_hash: str | None,
    handled: tuple[str, ...],
    deployment: Mapping[str, Any] | None,
) -> Observed:
    serving = {
        str(p["metadata"]["name"])
        for p in world.pods
        if pods.pod_ready(p) and pods.carried_template_hash(p) == current_hash
    }
    reports = [r for r in world.reports if r[0] in serving]
    observation = aggregate(reports, world.now, settings.stale_after)
    ended = pods.new_terminations(world.pods, set(handled), world.counted_runs)
    ample_since = policy.track_ample_headroom(state.ample_headroom_since, observation, spec, world.now)
    return Observed(
        current_hash=current_hash,
        reports=reports,
        observation=observation,
        terminations=ended,
        rollout=pods.rollout_state(deployment, current_hash or "", world.pods) if deployment else None,
        low_since=policy.track_low_headroom(state.low_headroom_since, observation, spec, world.now),
        ample_since=ample_since,
        ample_lowest=policy.track_ample_lowest(
            state.ample_headroom_lowest, state.ample_headroom_since, ample_since, observation
        ),
        # any vLLM run that ended starts the trend over; the policy never reads it
        trend=memory_trend.track(
            state.memory_trend,
            observation,
            key=memory_trend.serving_key(world.pods, current_hash),
            now=world.now,
            restarted=bool(ended),
        ),
        unscheduled=blockers.unschedulable(
            world.pods,
            state.unschedulable_since,
            world.now,
            gpus=spec.gpus_per_pod,
            gpu_resource=spec.resources.gpu_resource_name,
        ),
        stuck=pod_blockers.pod_blockers(
            world.pods,
            state.stuck_since,
            world.now,
            deployment=world.deployment if spec.distributed is None else None,
            statefulsets=world.statefulsets,
            events=world.events,
        ),
    )
