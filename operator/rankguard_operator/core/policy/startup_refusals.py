"""Rule 1's start-up refusals: vLLM's worker refused to start in `request_memory` (v1
worker/utils.py) before it allocated anything, so the KV budget is not what failed.

- "Free memory on device ... on startup is less than ..." under a byte budget: the free memory
  was below the utilisation rankguard renders next to the budget for this check. The budget
  stays; the next render keeps that utilisation under the free memory vLLM measured
  (status.engine.startupFreeBytes).
- "Externally held weights on device ... exceed the desired GPU memory utilization": weights
  another process holds on the GPU (a zero-copy weight cache, `--load-format ipc_cache`) reach
  total × utilisation, so nothing is left for the engine. A smaller KV budget cannot help; the
  utilisation must rise above those weights. Under a byte budget that utilisation is rankguard's
  own: it now stays above them (status.engine.externalWeightBytes, budget.startup_utilization)
  and the budget stays. Under a utilisation alone rankguard switches to the plan's byte budget,
  whose rendered utilisation does the same. Weights that leave no room at all, or no plan to
  switch to, are Degraded with what a person can change.

Any other refusal (one under a utilisation alone) is an OOM like the rest: rule 1 goes on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rankguard_operator.core.budget.bounds import kv_floor
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.policy.budget_change import budget_change, utilization_base
from rankguard_operator.core.policy.decision import Decision, PolicyInput, make_decision, rank_text
from rankguard_operator.core.policy.tunables import T_CUDA_OOM
from rankguard_operator.core.units import format_bytes


def startup_refusal(inp: PolicyInput, ooms: Sequence[Termination], worst: Termination) -> Decision | None:
    """The decision when every OOM of this pass is a start-up refusal that rankguard answers
    without shrinking (see the module docstring); None to go on with rule 1."""
    cur = inp.current
    assert cur is not None
    if not all(t.startup_refusal for t in ooms):
        return None
    if any(t.external_weight_bytes for t in ooms):
        return _external_weights(inp, ooms)
    if cur.kv_cache_memory_bytes is None:
        return None
    free = "" if worst.free_bytes is None else f" with {format_bytes(worst.free_bytes)} free at start-up"
    return make_decision(
        inp,
        "none",
        cur,
        trigger=T_CUDA_OOM,
        reason="StartupCheckRefused",
        message=f"vLLM refused to start on {rank_text(worst.rank)} in pod {worst.pod_name}{free}: "
        f"less than the utilisation rendered for its start-up check; the per-GPU KV budget "
        f"{cur.budget_text()} stays, and that utilisation now stays under what vLLM measured",
        rank=worst.rank,
        handled=[t.key for t in ooms],
    )


def _external_weights(inp: PolicyInput, ooms: Sequence[Termination]) -> Decision:
    """Weights held outside the process reached total × utilisation (the module docstring)."""
    cur, spec, plan = inp.current, inp.spec, inp.plan
    assert cur is not None
    keys = [t.key for t in ooms]
    worst = max(ooms, key=lambda t: t.external_weight_bytes or 0)
    weights = worst.external_weight_bytes or 0
    on = f"{rank_text(worst.rank)} in pod {worst.pod_name}"
    share = ""
    if worst.requested_bytes is not None:
        share = f" (the utilisation's share is {format_bytes(worst.requested_bytes)}"
        share += f" of {format_bytes(worst.total_bytes)})" if worst.total_bytes is not None else ")"
    what = (
        f"vLLM refused to start on {on}: the weights another process holds on the GPU "
        f"({format_bytes(weights)}) exceed its GPU memory utilisation{share}, so it allocated no KV cache"
    )
    margin = spec.memory.safety_margin_bytes
    total = worst.total_bytes
    if total is not None and weights + margin >= total:
        return make_decision(
            inp,
            "degrade",
            cur,
            trigger=T_CUDA_OOM,
            reason="ExternalWeightsFillGPU",
            message=f"{what}; with the {format_bytes(margin)} safety margin they leave nothing of the "
            f"GPU's {format_bytes(total)} for the engine, and no utilisation can fix that: free the GPU "
            "memory the other process holds, or spread the model over more GPUs "
            "(spec.tensorParallelSize)",
            rank=worst.rank,
            handled=keys,
        )
    if cur.kv_cache_memory_bytes is not None:
        return make_decision(
            inp,
            "none",
            cur,
            trigger=T_CUDA_OOM,
            reason="ExternalWeightsRefused",
            message=f"{what}; the per-GPU KV budget {cur.budget_text()} stays, and the utilisation "
            f"rendered next to it now stays above those {format_bytes(weights)}",
            rank=worst.rank,
            handled=keys,
        )
    if not spec.memory.pinned and plan is not None and plan.kv_cache_memory_bytes >= kv_floor(spec, plan):
        return budget_change(
            inp,
            "replan",
            plan.kv_cache_memory_bytes,
            utilization_base(plan, cur),
            trigger=T_CUDA_OOM,
            why=what,
            rank=worst.rank,
            handled=keys,
            how=" (the planned explicit budget; the utilisation rendered next to it stays above "
            "the weights held outside)",
        )
    least = "" if total is None else f" to at least {math.ceil((weights + margin) / total * 100) / 100:g}"
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_CUDA_OOM,
        reason="ExternalWeightsRefused",
        message=f"{what}; rankguard has no planned per-GPU KV budget to switch to: raise "
        f"spec.memory.gpuMemoryUtilization{least}, or set spec.memory.gpuMemoryBytes so rankguard "
        "can plan one",
        rank=worst.rank,
        handled=keys,
    )
