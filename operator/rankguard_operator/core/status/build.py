"""Builders for an LLMService's `.status`: the per-rank table, printer-column strings, the
budget, conditions, phase, bounded history, and the patch that writes only what changed.

Field names follow crds/llmservice.yaml. The printer columns (READY, KV-BUDGET, RANK0,
MIN-HEADROOM, BOTTLENECK, PHASE) read pre-formatted strings, so they are built here in the
binary units `kubectl top` uses (`1.9Gi`).

Pure: no I/O, no clock (times come in as arguments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_operator.core.budget.bounds import equivalent_utilization, is_measured, utilization_kv_bytes
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.conditions import Condition, condition, phase_for, set_condition
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.observe.memory_trend import MemoryTrend
from rankguard_operator.core.observe.pod_blockers import ENGINE_REFUSED_ARGUMENTS
from rankguard_operator.core.observe.pod_blockers import REASONS as POD_BLOCKER_REASONS
from rankguard_operator.core.observe.pods import RolloutState
from rankguard_operator.core.policy import Decision
from rankguard_operator.core.policy.history import Remediation, history_from_status
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.capacity import capacity_status
from rankguard_operator.core.status.creep import memory_creep_condition
from rankguard_operator.core.status.groups import GroupFigure, bounded_rank_lines
from rankguard_operator.core.units import format_bytes

HISTORY_LIMIT = 20  # the CRD's maxItems for status.remediations

# Degraded reasons that say rankguard has done all it may: the same failure comes back at the
# next load peak, and a pod that restarts and turns ready in between does not make the service
# healthy. They stay (the condition kept as written, with the generation it was written for)
# until the flags change or a person changes the spec.
STICKY_REASONS = ("OOMAtFloor", "PinnedBudgetOOM", "MemoryLimitAtCap")
# Degraded reasons that describe what holds now (a pod the scheduler cannot place or that cannot
# start, core/observe/pod_blockers; a spec that cannot be served): they go as soon as it no
# longer holds, never kept "until ready" (a spec that was fixed is being deployed, not invalid).
# (NameTaken, ModelCacheClaimTaken: core/step/surroundings.refusal, while another service holds it)
# A refusal of the engine's arguments is not one of them: it stays until the service is ready, so
# a fixed spec's pods, judged anew, clear it by serving (not by merely starting to load weights).
OBSERVED_REASONS = (
    "Unschedulable",
    "InvalidSpec",
    "NameTaken",
    "ModelCacheClaimTaken",
    *(r for r in POD_BLOCKER_REASONS if r != ENGINE_REFUSED_ARGUMENTS),
)


# --------------------------------------------------------------------------------------------
# Ranks and printer columns


def rank_rows(observation: Observation | None, tp: int = 1) -> list[dict[str, Any]]:
    """`status.ranks`: one row per rank (its worst replica), stale rows marked."""
    if observation is None:
        return []
    return [
        {
            "rank": r.rank,
            "uuid": r.uuid[:128],
            "pod": r.pod[:253],
            "stage": r.rank // tp,
            "totalBytes": r.total_bytes,
            "freeBytes": r.free_bytes,
            "minFreeBytes": r.min_free_bytes,
            "headroomBytes": r.headroom_bytes,
            "headroom": format_bytes(r.headroom_bytes),
            "stale": r.stale,
        }
        for r in observation.ranks
    ]


def rank_lines(observation: Observation | None) -> list[str]:
    """`status.perRank`: one readable line per rank (kubectl describe runs the fields of a list
    of objects together; a list of strings prints one per line), the tightest PER_RANK_LINES
    of them when there are more (core/status/groups: status.ranks keeps every rank)."""
    if observation is None:
        return []
    return bounded_rank_lines(
        [
            (
                r.headroom_bytes,
                f"rank {r.rank}: headroom {format_bytes(r.headroom_bytes)}, "
                f"free {format_bytes(r.free_bytes)} of {format_bytes(r.total_bytes)} "
                f"(GPU {r.uuid[:64]}, pod {r.pod[:253]})" + (", stale" if r.stale else ""),
            )
            for r in observation.ranks
        ]
    )


def bottleneck_text(rank: int, pod: str, spec: ServiceSpec | None) -> str:
    """ "rank 2"; with pipeline stages "rank 13 (stage 1)"; in a multi-node group "… on <pod>"."""
    if spec is None or (spec.pp == 1 and spec.distributed is None):
        return f"rank {rank}"
    text = f"rank {rank} (stage {rank // spec.tp})"
    return text if spec.distributed is None else f"{text} on {pod[:253]}"


def summary_fields(
    observation: Observation | None,
    flags: ServingFlags | None,
    ready_replicas: int,
    replicas: int,
    spec: ServiceSpec | None = None,
) -> dict[str, Any]:
    """The printer-column strings. A value rankguard does not know is None, so a status patch
    removes it and `kubectl get` shows <none> rather than an old figure; a rank known only
    from stale reports shows `stale`."""
    b = observation.bottleneck if observation is not None else None
    rank0 = observation.rank(0) if observation is not None else None
    if rank0 is None:
        rank0_text = None
    elif rank0.stale:
        rank0_text = "stale"
    else:
        rank0_text = format_bytes(rank0.headroom_bytes)
    return {
        "ready": f"{ready_replicas}/{replicas}",
        "readyReplicas": ready_replicas,
        "kvBudget": None if flags is None else flags.budget_text(),
        "rank0Headroom": rank0_text,
        "minHeadroom": None if b is None else format_bytes(b.headroom_bytes),
        "bottleneck": None if b is None else bottleneck_text(b.rank, b.pod, spec),
        "bottleneckRank": None if b is None else b.rank,
        "bottleneckPod": None if b is None else b.pod[:253],
        "bottleneckStage": None if b is None or spec is None else b.rank // spec.tp,
    }


# --------------------------------------------------------------------------------------------
# Budget


def budget_source(
    plan: Plan | None,
    flags: ServingFlags,
    spec: ServiceSpec,
    last_remediation: Remediation | None = None,
) -> str:
    """Where the budget in effect came from: pinned, utilization, rolled-back, remediated,
    measured (a plan with probe figures) or planned (a plan from priors)."""
    if spec.memory.pinned:
        return "pinned"
    if flags.engine_measured:
        return "engine-measured"
    if flags.kv_cache_memory_bytes is None:
        return "utilization"
    last = last_remediation
    if last is not None and last.to_flags.kv_cache_memory_bytes == flags.kv_cache_memory_bytes:
        if last.action == "rollback":
            return "rolled-back"
        if last.action == "replan":
            return "measured" if last.trigger == "Measured" else "planned"
        if last.action in ("shrink", "grow", "degrade"):
            return "remediated"
    if plan is not None and plan.kv_cache_memory_bytes == flags.kv_cache_memory_bytes:
        return "measured" if is_measured(plan) else "planned"
    return "remediated" if last is not None else "planned"


def budget_status(
    plan: Plan | None,
    flags: ServingFlags | None,
    spec: ServiceSpec,
    *,
    last_remediation: Remediation | None = None,
) -> dict[str, Any]:
    """`status.budget`: bytes, the equivalent utilisation, blocks, tokens, max concurrency and
    source. Capacity figures need the plan (the model's shape); in utilisation mode they are
    the plan's estimate of what that utilisation leaves."""
    if flags is None:
        return {}
    doc: dict[str, Any] = {"source": budget_source(plan, flags, spec, last_remediation)}
    kv = flags.kv_cache_memory_bytes
    if kv is not None:
        doc["kvCacheMemoryBytes"] = kv
        if plan is not None:
            doc["gpuMemoryUtilization"] = equivalent_utilization(plan, kv)
    elif flags.engine_measured:
        # the engine sized it after warm-up: its own figures are in status.sizing, not a plan's guess
        if flags.gpu_memory_utilization is not None:
            doc["gpuMemoryUtilization"] = flags.gpu_memory_utilization
        return doc
    elif flags.gpu_memory_utilization is not None:
        doc["gpuMemoryUtilization"] = flags.gpu_memory_utilization
        if plan is not None:
            kv = utilization_kv_bytes(plan, flags.gpu_memory_utilization)
    if plan is not None and kv is not None:
        cap = plan.capacity(kv)
        doc.update(blocks=cap.blocks, tokens=cap.tokens, maxConcurrency=round(cap.max_concurrency, 2))
    return doc


def last_known_good_status(
    flags: ServingFlags | None, spec: ServiceSpec, prior: Plan | None
) -> dict[str, Any] | None:
    """`status.lastKnownGood`: the flags as the CRD keeps them (the vLLM arguments, rendered
    with the spec's `prior` plan as the Deployment is, the budget and the memory limit).
    `ServingFlags.from_status` reads this object back directly."""
    if flags is None:
        return None
    return {**flags.to_status(), "flags": vllm_args(spec, flags, prior)}


# --------------------------------------------------------------------------------------------
# History


def append_history(
    history: Sequence[Mapping[str, Any]], entry: Mapping[str, Any] | Remediation, limit: int = HISTORY_LIMIT
) -> list[dict[str, Any]]:
    """`history` + `entry` (a status dict or a Remediation), keeping the newest `limit`."""
    doc = entry.to_status() if isinstance(entry, Remediation) else dict(entry)
    out = [dict(h) for h in history] + [doc]
    return out[-limit:] if limit > 0 else []


# --------------------------------------------------------------------------------------------
# The whole status


# One condition as this pass says it: (status, reason, message)
_Said = tuple[str, str, str]
_NOT_DEGRADED: _Said = ("False", "AsExpected", "rankguard has nothing it cannot fix")


def _conditions(
    old: Sequence[Mapping[str, Any]],
    *,
    spec: ServiceSpec,
    now_iso: str,
    generation: int,
    flags: ServingFlags | None,
    decision: Decision | None,
    rollout: RolloutState | None,
    ready_replicas: int,
    last: Remediation | None,
    blocker: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    rolled = rollout is not None and rollout.complete
    ready = ready_replicas >= spec.replicas and (rollout is None or rolled)
    degraded = _degraded(
        old, generation, flags=flags, decision=decision, last=last, blocker=blocker, ready=ready
    )
    said: tuple[tuple[Condition, _Said | None], ...] = (
        (Condition.READY, _ready(ready, ready_replicas, spec.replicas)),
        (Condition.PROGRESSING, _progressing(rollout)),
        (Condition.REMEDIATING, _remediating(decision, last, flags, rolled)),
        (Condition.DEGRADED, degraded),
        (Condition.BUDGET_PLANNED, _budget_planned(flags)),
    )
    conds = [dict(c) for c in old]
    for type_, condition_said in said:
        if condition_said is not None:  # None: kept as written
            conds = set_condition(conds, type_, *condition_said, now_iso, generation)
    return conds


def _ready(ready: bool, ready_replicas: int, want: int) -> _Said:
    if ready:
        return ("True", "ReplicasReady", f"{ready_replicas}/{want} replicas ready")
    return ("False", "ReplicasNotReady", f"{ready_replicas}/{want} replicas ready")


def _progressing(rollout: RolloutState | None) -> _Said:
    if rollout is None:
        return ("Unknown", "NoDeployment", "")
    if rollout.phase == "unknown":
        return ("Unknown", rollout.reason, rollout.message)
    if rollout.phase == "progressing":
        return ("True", "RollingOut", rollout.message)
    if rollout.phase == "failed":
        return ("False", rollout.reason, rollout.message)
    return ("False", "RolloutComplete", "every replica runs the current flags")


def _remediating(
    decision: Decision | None, last: Remediation | None, flags: ServingFlags | None, rolled: bool
) -> _Said:
    """Remediating: a change rankguard made is rolling out (or was just decided)."""
    if decision is not None and decision.is_remediation:
        return ("True", decision.reason, decision.message)
    if last is not None and flags is not None and last.to_flags == flags and not rolled:
        return ("True", "RollingOut", f"rolling out {last.to_flags.describe()} ({last.trigger})")
    return ("False", "Idle", "no automatic change in progress")


def _degraded(
    old: Sequence[Mapping[str, Any]],
    generation: int,
    *,
    flags: ServingFlags | None,
    decision: Decision | None,
    last: Remediation | None,
    blocker: tuple[str, str] | None,
    ready: bool,
) -> _Said | None:
    """Degraded as this pass says it (None: kept as written). This pass's decision first; then a
    rollback; then what blocks the service now; then what the old condition said."""
    if decision is not None and decision.action in ("degrade", "hold"):
        return ("True", decision.reason, decision.message)
    # After a rollback the service runs, but not as asked: it stays Degraded, with the reason,
    # until another change is made (by rankguard or by a person through the spec).
    if last is not None and last.action == "rollback" and flags == last.to_flags:
        return (
            "True",
            "RolledBack",
            f"{last.message}. The service runs the last known good flags; fix the cause (see the "
            "pods' events and logs) or change the spec to try again.",
        )
    if blocker is not None:
        return ("True", *blocker)
    return _degraded_carried(condition(old, Condition.DEGRADED) or {}, generation, decision, ready)


def _degraded_carried(
    old_degraded: Mapping[str, Any], generation: int, decision: Decision | None, ready: bool
) -> _Said | None:
    """The last pass's Degraded when this pass has nothing new to say: it sticks until the
    service is ready on a completed rollout (a crash-looping service alternates between
    "degrade", a new crash, and "none", between crashes), a sticky reason until the flags or
    the spec change, an observed one not at all (it went when its cause went)."""
    old_true = old_degraded.get("status") == "True"
    old_reason = str(old_degraded.get("reason") or "")
    if old_true and old_reason in STICKY_REASONS:
        changed = (decision is not None and decision.changes_flags) or (
            old_degraded.get("observedGeneration") != generation
        )
        # unchanged: kept as written (the generation it was written for marks the spec it is about)
        return _NOT_DEGRADED if changed else None
    if old_true and old_reason not in OBSERVED_REASONS and not ready:
        return ("True", old_reason or "Degraded", str(old_degraded.get("message") or ""))
    return _NOT_DEGRADED


def _budget_planned(flags: ServingFlags | None) -> _Said:
    if flags is None:
        return ("Unknown", "NotRendered", "no flags rendered yet")
    if flags.kv_cache_memory_bytes is not None:
        return ("True", "ExplicitBudget", f"per-GPU KV budget {flags.budget_text()}")
    if flags.engine_measured:
        return ("True", "EngineMeasured", f"running {flags.describe()}")
    return ("False", "Utilization", f"running {flags.describe()} until a budget is known")


def build_status(
    *,
    old: Mapping[str, Any],
    spec: ServiceSpec,
    generation: int,
    now_iso: str,
    observation: Observation | None,
    flags: ServingFlags | None,
    last_known_good: ServingFlags | None,
    plan: Plan | None,
    prior: Plan | None,
    decision: Decision | None,
    rollout: RolloutState | None,
    ready_replicas: int,
    history: Sequence[Mapping[str, Any]],
    blocker: tuple[str, str] | None = None,
    memory_trend: MemoryTrend | None = None,
    groups: Sequence[GroupFigure] | None = None,
    budget_key: str | None = None,
) -> dict[str, Any]:
    """Every status field rankguard owns, rebuilt from this pass's inputs. Feed it with the old
    status to `status_patch`: fields set to None here are removed, other fields are kept.
    `blocker`: (reason, message) of something observed that keeps the service from serving
    (core/observe/blockers), Degraded while it lasts unless this pass's decision says more.
    `memory_trend`: the tightest rank's headroom over hours (core/observe/memory_trend), shown
    as `status.memoryTrend` and the MemoryCreep condition. `groups`: a multi-node service's
    per-group figures (core/status/groups), None for one pod per replica. `budget_key`: this
    pass's (bounds.budget_key): an engine's capacity figure is kept while it is unchanged."""
    parsed = history_from_status(list(history))
    last = parsed[-1] if parsed else None
    conditions = _conditions(
        list(old.get("conditions") or []),
        spec=spec,
        now_iso=now_iso,
        generation=generation,
        flags=flags,
        decision=decision,
        rollout=rollout,
        ready_replicas=ready_replicas,
        last=last,
        blocker=blocker,
    )
    conditions = set_condition(
        conditions,
        Condition.MEMORY_CREEP,
        *memory_creep_condition(memory_trend, spec, list(old.get("conditions") or [])),
        now_iso,
        generation,
    )
    return {
        "phase": phase_for(conditions).value,
        "observedGeneration": generation,
        "conditions": conditions,
        "ranks": rank_rows(observation, spec.tp),
        "perRank": rank_lines(observation) or None,
        "groupFigures": None if groups is None else [g.to_status() for g in groups],
        "perGroup": None if groups is None else [g.line(spec.tp) for g in groups] or None,
        **summary_fields(observation, flags, ready_replicas, spec.replicas, spec),
        "budget": budget_status(plan, flags, spec, last_remediation=last) or None,
        "capacity": capacity_status(plan, flags, spec, observation, old=old, budget_key=budget_key),
        "lastKnownGood": last_known_good_status(last_known_good, spec, prior),
        "remediations": [dict(h) for h in history][-HISTORY_LIMIT:],
        "memoryTrend": None
        if memory_trend is None
        else memory_trend.to_status(spec.memory.min_headroom_bytes),
    }
