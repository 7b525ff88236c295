"""Rules 6-9: live headroom (a grow made it worse, sustained low headroom), a measured re-plan,
and reclaiming idle headroom."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rankguard_agent.wire.termination import PHASE_KV_ALLOCATION
from rankguard_operator.core.budget.bounds import block_unit, is_measured, kv_ceiling, round_down
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.policy.budget_change import (
    after_kv_room,
    budget_change,
    effective_budget,
    utilization_base,
)
from rankguard_operator.core.policy.decision import (
    Decision,
    PolicyInput,
    last_change,
    make_decision,
    same_budget,
)
from rankguard_operator.core.policy.history import STATUS_ACTIONS
from rankguard_operator.core.policy.tunables import (
    BAD_BUDGET_MEMORY_SECONDS,
    GROW_VERIFY_SECONDS,
    HEADROOM_JITTER_BYTES,
    LOW_HEADROOM_SUSTAIN_SECONDS,
    MIN_CHANGE_BYTES,
    RECLAIM_AFTER_SECONDS,
    RECLAIM_HEADROOM_FACTOR,
    T_CUDA_OOM,
    T_HEADROOM_WORSE,
    T_LOW_HEADROOM,
    T_MEASURED,
    T_PLANNED,
    T_RECLAIM,
)
from rankguard_operator.core.units import format_bytes


def rule_headroom_worse(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    last = last_change(inp.history)
    cur, obs, spec = inp.current, inp.observation, inp.spec
    assert cur is not None
    if last is None or last.action != "grow" or inp.now - last.time > GROW_VERIFY_SECONDS:
        return None
    if inp.rollout is not None and not inp.rollout.complete:
        return None  # judge the grown budget only once every replica runs it
    b = obs.bottleneck if obs is not None else None
    if b is None or b.min_free_bytes >= spec.memory.min_headroom_bytes:
        return None
    before = last.from_flags or inp.last_known_good
    if before is None or same_budget(before, cur):
        return None
    target = replace(before, memory_limit_bytes=cur.memory_limit_bytes)
    return make_decision(
        inp,
        "rollback",
        target,
        trigger=T_HEADROOM_WORSE,
        reason=STATUS_ACTIONS["rollback"],
        message=(
            f"after growing the KV budget from {before.budget_text()} to {cur.budget_text()}, rank "
            f"{b.rank}'s headroom fell to {format_bytes(b.min_free_bytes)}, below the minimum "
            f"{format_bytes(spec.memory.min_headroom_bytes)}; rolling back to {before.budget_text()}"
        ),
        rank=b.rank,
    )


def rule_low_headroom(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, obs, spec = inp.current, inp.observation, inp.spec
    assert cur is not None
    b = obs.bottleneck if obs is not None else None
    minimum = spec.memory.min_headroom_bytes
    if b is None or b.min_free_bytes >= minimum or inp.low_headroom_since is None:
        return None
    lasted = inp.now - inp.low_headroom_since
    if lasted < LOW_HEADROOM_SUSTAIN_SECONDS:
        return None
    what = (
        f"rank {b.rank} has kept only {format_bytes(b.min_free_bytes)} of GPU memory free (pod "
        f"{b.pod}), below the "
        f"minimum headroom {format_bytes(minimum)}, for {lasted:.0f}s"
    )
    deficit = minimum - b.min_free_bytes
    # The headroom is measured, so over a byte budget the shrink is the deficit and the jitter
    # allowance, landing where reclaim would fill to; over a utilisation the budget it cuts from
    # may be the plan's estimate, so the spec's safety margin covers that estimate's error.
    exact = cur.kv_cache_memory_bytes is not None
    margin = HEADROOM_JITTER_BYTES if exact else spec.memory.safety_margin_bytes
    margin_text = "jitter allowance" if exact else "safety margin"
    if spec.memory.pinned:
        return replace(
            make_decision(
                inp,
                "hold",
                cur,
                trigger=T_LOW_HEADROOM,
                reason="PinnedBudget",
                message=(
                    f"{what}; the KV budget is pinned (spec.memory.kvCacheMemoryBytes), so rankguard does "
                    f"not shrink it: lower it by at least {format_bytes(deficit + margin)} before "
                    f"rank {b.rank} runs "
                    "out"
                ),
                rank=b.rank,
            ),
            held_action="shrink",
        )
    eff = effective_budget(inp, None, b.rank)
    if eff is None:
        return None  # utilisation mode with nothing to convert from: the OOM rule will speak up
    base, base_text = eff
    how = f" (headroom deficit {format_bytes(deficit)} plus the {format_bytes(margin)} {margin_text})"
    if cur.kv_cache_memory_bytes is None:
        how += f"; switching from gpu-memory-utilization to bytes, starting from {base_text}"
    return budget_change(
        inp, "shrink", base - deficit - margin, base, trigger=T_LOW_HEADROOM, why=what, rank=b.rank, how=how
    )


def rule_replan(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, spec, plan = inp.current, inp.spec, inp.plan
    assert cur is not None
    if plan is None or spec.memory.pinned or spec.memory.gpu_memory_utilization is not None:
        return None
    trigger = T_MEASURED if is_measured(plan) else T_PLANNED
    if cur.kv_cache_memory_bytes is None:
        gpu = min(r.total_bytes for r in plan.ranks)
        return budget_change(
            inp,
            "replan",
            plan.kv_cache_memory_bytes,
            utilization_base(plan, cur),
            trigger=trigger,
            why=(
                f"one GPU's memory is now known ({format_bytes(gpu)}) and rank "
                f"{plan.bottleneck_rank} is the bottleneck"
            ),
            rank=plan.bottleneck_rank,
            how=" (the planner's budget replaces gpu-memory-utilization)",
        )
    if inp.history or not is_measured(plan):
        return None
    diff = plan.kv_cache_memory_bytes - cur.kv_cache_memory_bytes
    if abs(diff) < max(MIN_CHANGE_BYTES, block_unit(plan)):
        return None
    if diff > 0:
        # The probe sees what NCCL takes at init, not the buffers it allocates lazily on the
        # first real traffic (~4.5 GiB under TP per vLLM PR #25359; more on a pipeline-terminal
        # rank). A measurement can therefore show a rank heavier than the prior, never prove it
        # lighter: growing is left to reclaim, which watches live headroom under real load.
        return None
    return budget_change(
        inp,
        "replan",
        plan.kv_cache_memory_bytes,
        cur.kv_cache_memory_bytes,
        trigger=trigger,
        why=f"the agent's probe measured every rank after NCCL init and rank {plan.bottleneck_rank} is the "
        "bottleneck",
        rank=plan.bottleneck_rank,
        how=" (the measured plan replaces the prior one)",
    )


def bad_budget_cap(inp: PolicyInput, unit: int) -> int | None:
    """For a day after a crash or regression, growing stops at the budget that fixed it; after
    a pressure shrink, one block below the budget that was under pressure. A KV-allocation OOM's
    cut also left the plan's room for what comes after the KV cache (crash_rules.rule_cuda_oom),
    a prior that may overstate it: that room is not a budget that failed, so growing may take it
    back as far as live headroom shows it unused, never to the budget that failed."""
    caps = []
    for h in inp.history:
        if inp.now - h.time > BAD_BUDGET_MEMORY_SECONDS:
            continue
        to = h.to_flags.kv_cache_memory_bytes
        if h.trigger == T_CUDA_OOM and h.phase == PHASE_KV_ALLOCATION and to is not None:
            room = after_kv_room(inp, h.rank)
            failed = h.from_flags.kv_cache_memory_bytes if h.from_flags is not None else None
            back = to + round_down(room[0], unit) if room is not None else to
            caps.append(back if failed is None else max(to, min(back, failed - unit)))
        elif h.trigger in (T_CUDA_OOM, T_HEADROOM_WORSE) and to is not None:
            caps.append(to)
        elif h.trigger == T_LOW_HEADROOM and h.from_flags is not None and h.from_flags.kv_cache_memory_bytes:
            caps.append(h.from_flags.kv_cache_memory_bytes - unit)
    return min(caps) if caps else None


def rule_reclaim(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, spec, obs = inp.current, inp.spec, inp.observation
    assert cur is not None
    kv = cur.kv_cache_memory_bytes
    if not spec.memory.reclaim or spec.memory.pinned or kv is None:
        return None
    since = inp.ample_headroom_since
    if since is None or inp.now - since < RECLAIM_AFTER_SECONDS:
        return None
    last = last_change(inp.history)
    if last is not None and inp.now - last.time < RECLAIM_AFTER_SECONDS:
        return None  # the headroom must have been ample under the current flags
    if inp.rollout is not None and not inp.rollout.complete:
        return None
    if obs is None or not obs.has_fresh_data:
        return None
    threshold = RECLAIM_HEADROOM_FACTOR * spec.memory.min_headroom_bytes
    if any(r.min_free_bytes < threshold for r in obs.fresh_ranks):
        return None
    b = obs.bottleneck
    assert b is not None
    if inp.plan is None and spec.remediation.max_kv_cache_bytes is None:
        return None  # no plan and no spec.remediation.maxKVCacheBytes: never grow blind
    unit = block_unit(inp.plan)
    # The stretch's lowest free memory is measured under serving and already holds the engine's
    # worst transients: vLLM runs its profile pass at max-num-batched-tokens and warms the
    # sampler at max-num-seqs at start-up, and PyTorch's caching allocator keeps those blocks
    # reserved, so NVML counts them. It therefore replaces the plan's prior ceiling; without it
    # (a stretch begun before the operator tracked its lowest) the prior still caps the grow.
    tracked = inp.ample_headroom_lowest
    caps = [kv_ceiling(spec, None if tracked is not None else inp.plan), bad_budget_cap(inp, unit)]
    lowest = b.min_free_bytes if tracked is None else min(b.min_free_bytes, tracked)
    step = round_down(lowest - spec.memory.min_headroom_bytes - HEADROOM_JITTER_BYTES, unit)
    target = min([kv + step, *(c for c in caps if c is not None)])
    if target - kv < max(MIN_CHANGE_BYTES, unit):
        return None
    capped = f", capped at {format_bytes(target)}" if target < kv + step else ""
    return budget_change(
        inp,
        "grow",
        target,
        kv,
        trigger=T_RECLAIM,
        why=f"every rank has kept at least {format_bytes(threshold)} free for "
        f"{(inp.now - since) / 60:.0f} min "
        f"(bottleneck rank {b.rank}: at least {format_bytes(lowest)})",
        rank=b.rank,
        how=f" (filling the bottleneck's lowest free memory, less the minimum headroom and "
        f"{format_bytes(HEADROOM_JITTER_BYTES)} of jitter, in whole blocks{capped})",
    )
