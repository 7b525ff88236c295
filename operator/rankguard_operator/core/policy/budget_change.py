"""Turning a wanted KV budget into a decision: whole blocks, within the floor and ceiling, or
Degraded at the floor; and the byte budget in effect when the flags say only a utilisation."""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.budget.bounds import (
    after_kv_bytes,
    block_unit,
    kv_floor,
    round_down,
    utilization_kv_bytes,
)
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.policy.decision import Action, Decision, PolicyInput, make_decision, rank_text
from rankguard_operator.core.policy.history import STATUS_ACTIONS
from rankguard_operator.core.policy.tunables import (
    KNOBS,
    T_CUDA_OOM,
    UNKNOWN_DEFICIT_FRACTION,
    UNKNOWN_DEFICIT_MIN_BYTES,
)
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.units import format_bytes


def effective_budget(inp: PolicyInput, t: Termination | None, rank: int | None) -> tuple[int, str] | None:
    """The byte budget in effect when the flags say only a utilisation (see rule 1)."""
    cur = inp.current
    assert cur is not None
    if cur.kv_cache_memory_bytes is not None:
        return cur.kv_cache_memory_bytes, f"the KV budget {format_bytes(cur.kv_cache_memory_bytes)}"
    if t is not None and t.kv_cache_bytes:
        return t.kv_cache_bytes, f"the {format_bytes(t.kv_cache_bytes)} of KV cache vLLM reported in that run"
    obs = inp.observation
    if obs is not None and obs.has_fresh_data and obs.kv_cache_bytes:
        return obs.kv_cache_bytes, f"the {format_bytes(obs.kv_cache_bytes)} of KV cache vLLM reports"
    util = cur.gpu_memory_utilization
    if inp.plan is not None and util is not None:
        kv = utilization_kv_bytes(inp.plan, util, rank)
        if kv > 0:
            return kv, (
                f"the {format_bytes(kv)} of KV cache that gpu-memory-utilization {util:g} leaves on "
                f"{rank_text(rank)} by the plan's non-KV estimate"
            )
    return None


def clamped_target(inp: PolicyInput, action: Action, target: int) -> int:
    """`target` as `budget_change` would set it before the floor: whole blocks, a shrink always
    by at least one block, never above spec.remediation.maxKVCacheBytes."""
    cur = inp.current
    assert cur is not None
    unit = block_unit(inp.plan)
    target = round_down(target, unit)
    if action == "shrink" and cur.kv_cache_memory_bytes is not None:
        target = min(target, cur.kv_cache_memory_bytes - unit)  # a shrink always shrinks
    ceiling = inp.spec.remediation.max_kv_cache_bytes
    if ceiling is not None:
        target = min(target, ceiling)
    return target


def after_kv_room(inp: PolicyInput, rank: int | None) -> tuple[int, str] | None:
    """(bytes, what they are) a rank allocates after its KV cache, by the plan
    (budget.bounds.after_kv_bytes under the flags in effect: no graphs under --enforce-eager);
    None without a plan. A KV-allocation OOM's cut leaves this room, and reclaim may give it back
    once live headroom shows it unused (headroom_rules.bad_budget_cap)."""
    if inp.plan is None:
        return None
    spec_eager = inp.spec.engine.enforce_eager
    eager = spec_eager if inp.current is None else inp.current.or_spec("enforce_eager", spec_eager)
    what = (
        "a step's transients" if eager else "the CUDA-graph pool, the sampler warm-up and a step's transients"
    )
    if inp.plan.inputs.pp > 1:
        what += ", and on the last stage the NCCL memory pipeline traffic creates"
    return after_kv_bytes(inp.plan, rank, enforce_eager=eager), what


def oom_deficit(t: Termination, base: int) -> tuple[int, bool]:
    """(bytes a CUDA OOM was short by, assumed): the message's own figures, else an assumed
    max(UNKNOWN_DEFICIT_MIN_BYTES, UNKNOWN_DEFICIT_FRACTION of the budget `base`)."""
    if t.deficit_bytes is not None:
        return t.deficit_bytes, False
    return max(UNKNOWN_DEFICIT_MIN_BYTES, int(base * UNKNOWN_DEFICIT_FRACTION)), True


def budget_change(
    inp: PolicyInput,
    action: Action,
    target: int,
    base: int,
    *,
    trigger: str,
    why: str,
    rank: int | None,
    handled: Sequence[str] = (),
    how: str = "",
) -> Decision:
    """Set the KV budget to `target` (whole blocks, within floor and ceiling), or degrade at the floor."""
    cur = inp.current
    assert cur is not None
    spec, plan = inp.spec, inp.plan
    floor = kv_floor(spec, plan)
    target = clamped_target(inp, action, target)
    if target < floor:
        floor_why = floor_reason(spec, plan, floor)
        if cur.kv_cache_memory_bytes is None or cur.kv_cache_memory_bytes > floor:
            flags = cur.with_kv(floor)
            did = f"rankguard sets the floor {format_bytes(floor)} and reports the service Degraded"
        elif trigger == T_CUDA_OOM:
            return oom_at_floor(inp, why, floor, floor_why, rank=rank, handled=handled)
        else:
            flags = cur
            did = f"the budget is already at the floor {format_bytes(floor)}; the service is Degraded"
        return make_decision(
            inp,
            "degrade",
            flags,
            trigger=trigger,
            reason="BudgetAtFloor",
            message=(
                f"{why}; the KV budget would have to drop to {format_bytes(max(target, 0))}, below the floor "
                f"{format_bytes(floor)} ({floor_why}); {did}. To fix: {KNOBS}"
            ),
            rank=rank,
            handled=handled,
        )
    verb = {"shrink": "shrinking", "grow": "growing", "replan": "setting"}.get(action, "setting")
    return make_decision(
        inp,
        action,
        cur.with_kv(target),
        trigger=trigger,
        reason=STATUS_ACTIONS.get(action, STATUS_ACTIONS["replan"]),  # one name per action everywhere
        message=f"{why}; {verb} the per-GPU KV budget from {format_bytes(base)} to "
        f"{format_bytes(target)}{how}",
        rank=rank,
        handled=handled,
    )


def oom_at_floor(
    inp: PolicyInput, why: str, floor: int, floor_why: str, *, rank: int | None, handled: Sequence[str]
) -> Decision:
    """A CUDA OOM with the budget already at its floor: no smaller budget is allowed, so there is
    nothing left to roll. Degraded (status keeps it while the flags and the spec stay), naming
    what a person can change."""
    cur = inp.current
    assert cur is not None
    lower_floor = (
        "lower spec.remediation.minKVCacheBytes (it sets this floor), "
        if inp.spec.remediation.min_kv_cache_bytes == floor
        else ""
    )
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_CUDA_OOM,
        reason="OOMAtFloor",
        message=(
            f"{why}, and the per-GPU KV budget is already at its floor {format_bytes(floor)} "
            f"({floor_why}): rankguard cannot shrink it further and rolls nothing more. To fix: "
            f"{lower_floor}lower spec.engine.maxModelLen or spec.engine.maxNumSeqs, spread the model "
            "over more GPUs (spec.tensorParallelSize), set spec.engine.kvCacheDtype: fp8, or use "
            "GPUs with more memory"
        ),
        rank=rank,
        handled=handled,
    )


def utilization_base(plan: Plan, cur: ServingFlags) -> int:
    """What the current utilisation gives by the plan's estimate (the "from" of a replan)."""
    u = cur.gpu_memory_utilization
    return utilization_kv_bytes(plan, u) if u is not None else plan.utilization_kv_bytes


def floor_reason(spec: ServiceSpec, plan: Plan | None, floor: int) -> str:
    parts = []
    if plan is not None and plan.min_kv_cache_memory_bytes == floor:
        parts.append(f"one request of maxModelLen {plan.max_model_len} tokens")
    if spec.remediation.min_kv_cache_bytes == floor:
        parts.append("spec.remediation.minKVCacheBytes")
    return " and ".join(parts) or "one KV block"
