"""Rule 0: the first flags of a service, and the flags after its budget inputs changed."""

from __future__ import annotations

from dataclasses import dataclass

from rankguard_operator.core.budget.bounds import block_unit, is_measured, kv_floor, round_down
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy.budget_change import floor_reason
from rankguard_operator.core.policy.decision import Decision, PolicyInput, make_decision
from rankguard_operator.core.policy.tunables import DEFAULT_START_UTILIZATION, KNOBS, T_FLOOR, T_SPEC_CHANGED
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.units import format_bytes


@dataclass(frozen=True)
class _Start:
    """The first flags as rule 0 picks them: a budget in bytes (`kv`) or a utilisation (`util`)."""

    reason: str
    message: str
    kv: int | None = None
    util: float | None = None
    rank: int | None = None
    below_floor: bool = False  # started at the floor, which may not fit: Degraded


def initial_decision(inp: PolicyInput, trigger: str) -> Decision:
    start = _from_spec(inp.spec) or (
        _awaiting_measurement() if inp.plan is None else _from_plan(inp.spec, inp.plan)
    )
    flags = ServingFlags(
        kv_cache_memory_bytes=start.kv,
        gpu_memory_utilization=start.util,
        memory_limit_bytes=_kept_memory_limit(inp),
    )
    lead = "the spec's budget inputs changed; " if trigger == T_SPEC_CHANGED else ""
    return make_decision(
        inp,
        "degrade" if start.below_floor else "initial",
        flags,
        trigger=T_FLOOR if start.below_floor else trigger,
        reason=start.reason,
        message=lead + start.message,
        rank=start.rank,
        handled=tuple(t.key for t in inp.new_terminations),
    )


def _kept_memory_limit(inp: PolicyInput) -> int | None:
    """A memory limit rankguard raised stays raised across a re-plan, unless the spec now asks
    for at least as much."""
    cur = inp.current
    if cur is None or cur.memory_limit_bytes is None:
        return None
    spec_limit = inp.spec.resources.memory_limit_bytes
    if spec_limit is None or cur.memory_limit_bytes > spec_limit:
        return cur.memory_limit_bytes
    return None


def _from_spec(spec: ServiceSpec) -> _Start | None:
    """The budget or utilisation the spec sets itself; None when it leaves it to rankguard."""
    m = spec.memory
    if m.kv_cache_memory_bytes is not None:
        return _Start(
            "BudgetPinned",
            f"the per-GPU KV budget is pinned at {format_bytes(m.kv_cache_memory_bytes)} by "
            "spec.memory.kvCacheMemoryBytes; rankguard measures every rank but never changes a pinned "
            "budget (it still raises the memory limit after an OOMKill)",
            kv=m.kv_cache_memory_bytes,
        )
    if m.gpu_memory_utilization is not None:
        return _Start(
            "UtilizationStart",
            f"starting with gpu-memory-utilization {m.gpu_memory_utilization:g} "
            "(spec.memory.gpuMemoryUtilization); the first CUDA OOM switches to an explicit per-GPU "
            "KV budget",
            util=m.gpu_memory_utilization,
        )
    return None


def _awaiting_measurement() -> _Start:
    return _Start(
        "AwaitingMeasurement",
        "one GPU's memory size is not known yet, so no per-GPU budget can be planned; "
        f"starting with gpu-memory-utilization {DEFAULT_START_UTILIZATION:g} until the agent reports "
        "the GPUs (set spec.memory.gpuMemoryBytes to plan before the pods run)",
        util=DEFAULT_START_UTILIZATION,
    )


def _from_plan(spec: ServiceSpec, plan: Plan) -> _Start:
    """The plan's budget, capped by the ceiling, and what to do when it is below the floor."""
    floor = kv_floor(spec, plan)
    target = plan.kv_cache_memory_bytes
    ceiling = spec.remediation.max_kv_cache_bytes
    capped = ""
    if ceiling is not None and target > ceiling:
        target = round_down(ceiling, block_unit(plan))
        capped = f", capped at spec.remediation.maxKVCacheBytes {format_bytes(ceiling)}"
    source = "the probe's measurements" if is_measured(plan) else "priors"
    b = plan.ranks[plan.bottleneck_rank]
    planned = (
        f"the planned per-GPU KV budget {format_bytes(target)} (from {source}; rank {b.rank} is the "
        "bottleneck)"
    )
    if target < floor and plan.feasible and floor == plan.min_kv_cache_memory_bytes:
        # The priors and the margin leave less than one request, but the least each rank can
        # need leaves room for it (planner: `feasible`): vLLM serves such setups (a 72B model at
        # TP2 on 80 GB cards), so start at one request and let the measurements decide.
        return _Start(
            "BudgetAtOneRequest",
            f"{planned} is below one request at max_model_len ({format_bytes(floor)}), but the "
            "least the ranks need beside the KV cache leaves room for it; starting at one request. "
            "rankguard measures every rank and grows the budget when live headroom allows",
            kv=floor,
            rank=b.rank,
        )
    if target < floor:
        return _Start(
            "BudgetBelowFloor",
            f"{planned} is below the floor {format_bytes(floor)} ({floor_reason(spec, plan, floor)}); "
            f"starting at the floor, which may not fit. To fix: {KNOBS}",
            kv=floor,
            rank=b.rank,
            below_floor=True,
        )
    return _Start(
        "BudgetPlanned",
        f"planned a per-GPU KV budget of {format_bytes(target)} from {source}{capped}: rank {b.rank} is the "
        f"bottleneck (non-KV {format_bytes(b.non_kv_bytes)} of {format_bytes(b.total_bytes)}, "
        f"{format_bytes(spec.memory.safety_margin_bytes)} safety margin); {plan.kv_tokens:,} tokens, max "
        f"concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens",
        kv=target,
        rank=b.rank,
    )
