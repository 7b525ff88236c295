"""Rule 0: the first flags of a service, and the flags after its budget inputs changed."""

from __future__ import annotations

from rankguard_operator.core.budget.bounds import block_unit, is_measured, kv_floor, round_down
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy.budget_change import floor_reason
from rankguard_operator.core.policy.decision import Decision, PolicyInput, make_decision
from rankguard_operator.core.policy.tunables import DEFAULT_START_UTILIZATION, KNOBS, T_FLOOR, T_SPEC_CHANGED
from rankguard_operator.core.units import format_bytes


def initial_decision(inp: PolicyInput, trigger: str) -> Decision:
    spec, plan, cur = inp.spec, inp.plan, inp.current
    handled = tuple(t.key for t in inp.new_terminations)
    # A memory limit rankguard raised stays raised across a re-plan, unless the spec now asks
    # for at least as much.
    limit = None
    if cur is not None and cur.memory_limit_bytes is not None:
        spec_limit = spec.resources.memory_limit_bytes
        if spec_limit is None or cur.memory_limit_bytes > spec_limit:
            limit = cur.memory_limit_bytes
    lead = "the spec's budget inputs changed; " if trigger == T_SPEC_CHANGED else ""
    m = spec.memory
    if m.kv_cache_memory_bytes is not None:
        return make_decision(
            inp,
            "initial",
            ServingFlags(kv_cache_memory_bytes=m.kv_cache_memory_bytes, memory_limit_bytes=limit),
            trigger=trigger,
            reason="BudgetPinned",
            message=f"{lead}the per-GPU KV budget is pinned at {format_bytes(m.kv_cache_memory_bytes)} by "
            "spec.memory.kvCacheMemoryBytes; rankguard measures every rank but never changes a pinned "
            "budget (it still raises the memory limit after an OOMKill)",
            handled=handled,
        )
    if m.gpu_memory_utilization is not None:
        return make_decision(
            inp,
            "initial",
            ServingFlags(gpu_memory_utilization=m.gpu_memory_utilization, memory_limit_bytes=limit),
            trigger=trigger,
            reason="UtilizationStart",
            message=f"{lead}starting with gpu-memory-utilization {m.gpu_memory_utilization:g} "
            "(spec.memory.gpuMemoryUtilization); the first CUDA OOM switches to an explicit per-GPU "
            "KV budget",
            handled=handled,
        )
    if plan is None:
        return make_decision(
            inp,
            "initial",
            ServingFlags(gpu_memory_utilization=DEFAULT_START_UTILIZATION, memory_limit_bytes=limit),
            trigger=trigger,
            reason="AwaitingMeasurement",
            message=f"{lead}one GPU's memory size is not known yet, so no per-GPU budget can be planned; "
            f"starting with gpu-memory-utilization {DEFAULT_START_UTILIZATION:g} until the agent reports "
            "the GPUs (set spec.memory.gpuMemoryBytes to plan before the pods run)",
            handled=handled,
        )
    floor = kv_floor(spec, plan)
    target = plan.kv_cache_memory_bytes
    ceiling = spec.remediation.max_kv_cache_bytes
    capped = ""
    if ceiling is not None and target > ceiling:
        target = round_down(ceiling, block_unit(plan))
        capped = f", capped at spec.remediation.maxKVCacheBytes {format_bytes(ceiling)}"
    source = "the probe's measurements" if is_measured(plan) else "priors"
    b = plan.ranks[plan.bottleneck_rank]
    if target < floor:
        return make_decision(
            inp,
            "degrade",
            ServingFlags(kv_cache_memory_bytes=floor, memory_limit_bytes=limit),
            trigger=T_FLOOR,
            reason="BudgetBelowFloor",
            message=(
                f"{lead}the planned per-GPU KV budget {format_bytes(target)} (from {source}; rank "
                f"{b.rank} is the "
                f"bottleneck) is below the floor {format_bytes(floor)} "
                f"({floor_reason(spec, plan, floor)}); starting "
                f"at the floor, which may not fit. To fix: {KNOBS}"
            ),
            rank=b.rank,
            handled=handled,
        )
    return make_decision(
        inp,
        "initial",
        ServingFlags(kv_cache_memory_bytes=target, memory_limit_bytes=limit),
        trigger=trigger,
        reason="BudgetPlanned",
        message=(
            f"{lead}planned a per-GPU KV budget of {format_bytes(target)} from {source}{capped}: "
            f"rank {b.rank} is the "
            f"bottleneck (non-KV {format_bytes(b.non_kv_bytes)} of {format_bytes(b.total_bytes)}, "
            f"{format_bytes(spec.memory.safety_margin_bytes)} safety margin); {plan.kv_tokens:,} tokens, max "
            f"concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens"
        ),
        rank=b.rank,
        handled=handled,
    )
