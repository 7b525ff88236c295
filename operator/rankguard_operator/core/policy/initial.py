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

    def start(
        reason: str,
        message: str,
        *,
        kv: int | None = None,
        util: float | None = None,
        rank: int | None = None,
    ) -> Decision:
        """The first flags: a budget in bytes (`kv`) or a utilisation (`util`), the limit kept."""
        flags = ServingFlags(kv_cache_memory_bytes=kv, gpu_memory_utilization=util, memory_limit_bytes=limit)
        return make_decision(
            inp,
            "initial",
            flags,
            trigger=trigger,
            reason=reason,
            message=lead + message,
            rank=rank,
            handled=handled,
        )

    if m.kv_cache_memory_bytes is not None:
        return start(
            "BudgetPinned",
            f"the per-GPU KV budget is pinned at {format_bytes(m.kv_cache_memory_bytes)} by "
            "spec.memory.kvCacheMemoryBytes; rankguard measures every rank but never changes a pinned "
            "budget (it still raises the memory limit after an OOMKill)",
            kv=m.kv_cache_memory_bytes,
        )
    if m.gpu_memory_utilization is not None:
        return start(
            "UtilizationStart",
            f"starting with gpu-memory-utilization {m.gpu_memory_utilization:g} "
            "(spec.memory.gpuMemoryUtilization); the first CUDA OOM switches to an explicit per-GPU "
            "KV budget",
            util=m.gpu_memory_utilization,
        )
    if plan is None:
        return start(
            "AwaitingMeasurement",
            "one GPU's memory size is not known yet, so no per-GPU budget can be planned; "
            f"starting with gpu-memory-utilization {DEFAULT_START_UTILIZATION:g} until the agent reports "
            "the GPUs (set spec.memory.gpuMemoryBytes to plan before the pods run)",
            util=DEFAULT_START_UTILIZATION,
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
    if target < floor and plan.feasible and floor == plan.min_kv_cache_memory_bytes:
        # The priors and the margin leave less than one request, but the least each rank can
        # need leaves room for it (planner: `feasible`): vLLM serves such setups (a 72B model at
        # TP2 on 80 GB cards), so start at one request and let the measurements decide.
        return start(
            "BudgetAtOneRequest",
            f"the planned per-GPU KV budget {format_bytes(target)} (from {source}; rank {b.rank} is the "
            f"bottleneck) is below one request at max_model_len ({format_bytes(floor)}), but the "
            "least the ranks need beside the KV cache leaves room for it; starting at one request. "
            "rankguard measures every rank and grows the budget when live headroom allows",
            kv=floor,
            rank=b.rank,
        )
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
    return start(
        "BudgetPlanned",
        f"planned a per-GPU KV budget of {format_bytes(target)} from {source}{capped}: rank {b.rank} is the "
        f"bottleneck (non-KV {format_bytes(b.non_kv_bytes)} of {format_bytes(b.total_bytes)}, "
        f"{format_bytes(spec.memory.safety_margin_bytes)} safety margin); {plan.kv_tokens:,} tokens, max "
        f"concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens",
        kv=target,
        rank=b.rank,
    )
