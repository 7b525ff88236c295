"""Rule 0: the first flags of a service, and the flags after its budget inputs changed."""

from __future__ import annotations

from dataclasses import dataclass

from rankguard_operator.core.budget.bounds import (
    block_unit,
    is_measured,
    kv_floor,
    round_down,
    utilization_kv_bytes,
)
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy.budget_change import floor_reason
from rankguard_operator.core.policy.decision import Decision, PolicyInput, make_decision, rank_text
from rankguard_operator.core.policy.history import Remediation
from rankguard_operator.core.policy.tunables import (
    BAD_BUDGET_MEMORY_SECONDS,
    DEFAULT_START_UTILIZATION,
    KNOBS,
    LEVER_KV,
    T_CUDA_OOM,
    T_FLOOR,
    T_SPEC_CHANGED,
)
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
    start = _clear_of_failed(inp, start)
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


def _failed_within_day(inp: PolicyInput) -> list[Remediation]:
    """The KV-budget answers to CUDA OOMs of the last day (BAD_BUDGET_MEMORY_SECONDS): each one's
    from-flags hold a budget or utilisation that ran out of GPU memory, its to-flags the byte
    budget that answered it. Another lever's move (batched tokens, capture size) says nothing
    about the budget."""
    return [
        h
        for h in inp.history
        if h.trigger == T_CUDA_OOM
        and inp.now - h.time <= BAD_BUDGET_MEMORY_SECONDS
        and h.lever in (None, LEVER_KV)
        and h.from_flags is not None
        and h.to_flags.kv_cache_memory_bytes is not None
    ]


def _ran_out(inp: PolicyInput, start: _Start, failed: Remediation) -> str | None:
    """What of `failed`'s flags the start would run again or exceed ("gpu-memory-utilization 0.9",
    "the KV budget 30Gi"), None when it starts below it. A utilisation and a byte budget are
    compared through the plan's estimate when there is one."""
    frm = failed.from_flags
    assert frm is not None
    bad_util, bad_kv = frm.gpu_memory_utilization, frm.kv_cache_memory_bytes
    if bad_kv is None and bad_util is not None:
        if start.util is not None and start.util >= bad_util:
            return f"gpu-memory-utilization {bad_util:g}"
        if (
            start.kv is not None
            and inp.plan is not None
            and start.kv >= utilization_kv_bytes(inp.plan, bad_util)
        ):
            return f"gpu-memory-utilization {bad_util:g}"
        return None
    if bad_kv is None:
        return None
    kv = start.kv
    if kv is None and start.util is not None and inp.plan is not None:
        kv = utilization_kv_bytes(inp.plan, start.util)
    return f"the KV budget {format_bytes(bad_kv)}" if kv is not None and kv >= bad_kv else None


def _clear_of_failed(inp: PolicyInput, start: _Start) -> _Start:
    """A re-render (a spec edit to a budget input) never restarts at a budget that ran out of GPU
    memory within the day: it starts at the byte budget rankguard answered that OOM with (or the
    start's own, when lower), as a crash would have moved it, instead of crash-looping through
    the OOM again and waiting out the cooldown to fix it (issue 50). A pinned budget is the
    person's own and is never moved."""
    if inp.spec.memory.pinned:
        return start
    failed = [(h, said) for h in _failed_within_day(inp) if (said := _ran_out(inp, start, h)) is not None]
    if not failed:
        return start
    answered = min(h.to_flags.kv_cache_memory_bytes or 0 for h, _ in failed)
    kv = answered if start.kv is None else min(start.kv, answered)
    kv = max(kv, kv_floor(inp.spec, inp.plan))
    if kv == start.kv:
        return start  # already at its floor: nothing lower may run
    h, said = min(failed, key=lambda f: f[0].to_flags.kv_cache_memory_bytes or 0)
    return _Start(
        "FailedBudgetAvoided",
        f"{start.message}; but {said} ran out of GPU memory {(inp.now - h.time) / 60:.0f} min ago "
        f"({rank_text(h.rank)}), within the day rankguard remembers a failed budget: starting at"
        f" the per-GPU KV budget {format_bytes(kv)} instead, the one that answered it",
        kv=kv,
        rank=h.rank if start.rank is None else start.rank,
        below_floor=start.below_floor,
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
