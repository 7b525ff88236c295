"""The policy: one PURE function from everything observed to one explainable decision.

`decide(PolicyInput) -> Decision`. The caller gathers the inputs (spec, the flags the
Deployment runs, last-known-good flags, the aggregated agent reports, the terminations not
yet handled, the rollout state, the remediation history, the plan) and applies the result:
render `decision.flags` when `decision.changes_flags`, record `decision.remediation(...)` in
the history when `decision.is_remediation`, emit an Event with `reason`/`message`, mark
`decision.handled` termination keys as handled, and come back after `retry_after` seconds
when an action was held.

Rules, in the order they are tried (the first that applies wins):

 0. No flags yet -> "initial": the pinned budget (spec.memory.kvCacheMemoryBytes, never
    remediated), or the starting utilisation (spec.memory.gpuMemoryUtilization; the first
    CUDA OOM switches to bytes), or the planner's budget (priors, or probe figures when the
    caller planned with them). With no plan yet (GPU size unknown) vLLM starts at
    utilisation 0.9 and rule 8 converts to bytes once the agents report the GPUs. The same
    happens when the spec's budget inputs changed (`budget_key`): trigger "SpecChanged".
 1. CUDA OOM on rank r -> shrink by the deficit (requested − free) plus the safety margin.
    In utilisation mode the budget in effect is not a flag, so it is taken, in this order,
    from vLLM's own "Available KV cache memory" line of the failed run, from the live
    reports, or from the plan (util × total − the plan's non-KV estimate of rank r); without
    any of those the service is Degraded with a message asking for a budget or GPU size.
    A deficit the message did not state counts as max(256 MiB, 5 % of the budget).
 2. KVCacheTooSmall (vLLM refused to start) -> in utilisation mode with a plan whose budget
    fits one request, switch to it; otherwise Degraded, naming the knobs.
 3. OOMKilled -> raise the memory limit as the VPA does: max(old + 100 MiB, old × ratio),
    capped at spec.remediation.maxHostMemory (and the node's memory when given); at the cap
    -> Degraded, naming the knob.
 4. Rollout failed (ProgressDeadlineExceeded) -> roll back to last-known-good; with nothing
    to roll back to -> Degraded.
 5. EngineError under flags that differ from last-known-good -> roll back.
 6. Within 15 min of a grow, the bottleneck's headroom fell below the minimum -> roll back
    to the budget before the grow ("HeadroomWorse").
 7. Bottleneck headroom below spec.memory.minHeadroomBytes for >= 60 s -> shrink by
    (minimum − headroom) + margin before an OOM happens.
 8. Measurement arrived: from utilisation-for-lack-of-a-plan to the plan's bytes, or, before
    any remediation, from the prior plan to the probe-measured plan ("replan").
 9. Reclaim (spec.memory.reclaim): every rank kept >= 2 × minHeadroom for >= 30 min and no
    change in that time -> grow by half the bottleneck's excess over the safety margin.

Guard rails on every flag change except "initial": spec.remediation.enabled false -> "hold";
then (rollbacks exempt: returning to known flags is always allowed) cooldown and maxPerHour
-> "hold" with `retry_after`. Every budget is whole KV blocks, never below the floor
(budget.kv_floor: one request at max_model_len, spec.remediation.minKVCacheBytes; below it ->
"degrade" at the floor) and never grown above the ceiling (budget.kv_ceiling, and for 24 h
never back past a budget that crashed or was under pressure).

Terminations of pods that ran other flags than the current ones are superseded (the change
they caused, or a later one, is already in place) and only marked handled.

Pure: no I/O, no clock (`now` is an input), deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rankguard_operator.budget import (
    block_unit,
    budget_key,
    is_measured,
    kv_ceiling,
    kv_floor,
    round_down,
    utilization_kv_bytes,
)
from rankguard_operator.budget import initial_plan as budget_plan
from rankguard_operator.flags import ServingFlags
from rankguard_operator.headroom import Observation, gpu_totals
from rankguard_operator.history import Remediation
from rankguard_operator.models import ModelShape
from rankguard_operator.observe import (
    CUDA_OOM,
    ENGINE_ERROR,
    KV_CACHE_TOO_SMALL,
    OOM_KILLED,
    RolloutState,
    Termination,
)
from rankguard_operator.planner import Plan
from rankguard_operator.spec import ServiceSpec
from rankguard_operator.units import MiB, format_bytes

Action = Literal[
    "none", "initial", "shrink", "raise-memory-limit", "grow", "rollback", "degrade", "hold", "replan"
]

# --------------------------------------------------------------------------------------------
# Tunables. Each says why it has the value it has.

# Low headroom must persist this long before a shrink: the agent's figure is already the
# minimum over its window, so one bad sample is not noise, but a single scrape can still
# catch a one-off (e.g. a CUDA-graph capture right after start).
LOW_HEADROOM_SUSTAIN_SECONDS = 60.0
# Reclaim needs headroom to stay ample for a long, load-varied stretch before spending a roll.
RECLAIM_AFTER_SECONDS = 1800.0
RECLAIM_HEADROOM_FACTOR = 2  # "ample" = every rank >= 2 × minHeadroomBytes
# A roll restarts a replica; changes smaller than this are not worth one (replan, reclaim).
MIN_CHANGE_BYTES = 256 * MiB
# How long after a grow a drop of the bottleneck below the minimum counts as the grow's fault.
GROW_VERIFY_SECONDS = 900.0
# Like the VPA, an OOM (or a regression) is remembered for a day: growing never goes back past
# the budget it left during that time.
BAD_BUDGET_MEMORY_SECONDS = 86400.0
# A CUDA OOM message without figures (e.g. "CUDA error: out of memory"): shrink by this much.
UNKNOWN_DEFICIT_MIN_BYTES = 256 * MiB
UNKNOWN_DEFICIT_FRACTION = 0.05
# Starting utilisation when no plan is possible yet (vLLM's own default is 0.92; a little lower
# leaves room for the rank-skew that rankguard has not measured yet).
DEFAULT_START_UTILIZATION = 0.9
# The VPA's OOM bump: max(old + 100 MiB, old × ratio).
VPA_MIN_BUMP_BYTES = 100 * MiB
RATE_WINDOW_SECONDS = 3600.0

# Triggers (the "why") and the CRD's action names for the history.
T_INITIAL = "Initial"
T_SPEC_CHANGED = "SpecChanged"
T_CUDA_OOM = "CUDAOutOfMemory"
T_KV_TOO_SMALL = "KVCacheTooSmall"
T_OOM_KILLED = "OOMKilled"
T_ROLLOUT_FAILED = "RolloutFailed"
T_ENGINE_ERROR = "EngineError"
T_HEADROOM_WORSE = "HeadroomWorse"
T_LOW_HEADROOM = "LowHeadroom"
T_MEASURED = "Measured"
T_PLANNED = "Planned"
T_RECLAIM = "Reclaim"
T_COOLDOWN = "Cooldown"
T_RATE_LIMIT = "RateLimit"
T_DISABLED = "RemediationDisabled"
T_FLOOR = "Floor"

_KNOBS = (
    "lower spec.engine.maxModelLen or spec.engine.maxNumSeqs, raise spec.tensorParallelSize, "
    "set spec.engine.kvCacheDtype: fp8, or use GPUs with more memory"
)


def _b(n: int) -> str:
    return format_bytes(n)


# --------------------------------------------------------------------------------------------
# Input and output


@dataclass(frozen=True)
class PolicyInput:
    spec: ServiceSpec
    now: float
    current: ServingFlags | None = None  # what the Deployment runs; None before the first render
    last_known_good: ServingFlags | None = None
    observation: Observation | None = None  # reports of pods running the current template
    new_terminations: Sequence[Termination] = ()  # not yet handled (the caller dedups by key)
    rollout: RolloutState | None = None
    history: Sequence[Remediation] = ()
    plan: Plan | None = None  # budget.initial_plan(spec, measured=...) or None
    low_headroom_since: float | None = None  # track_low_headroom
    ample_headroom_since: float | None = None  # track_ample_headroom
    budget_key: str | None = None  # budget.budget_key(spec) when `current` was chosen; None: unknown
    node_memory_bytes: int | None = None  # the node's allocatable memory, a cap for raising the limit


@dataclass(frozen=True)
class Decision:
    action: Action
    flags: ServingFlags  # the flags to run after this decision
    trigger: str
    reason: str  # CamelCase, for Events and Conditions
    message: str  # a sentence with the numbers, naming the knob when rankguard cannot fix it
    rank: int | None = None
    from_flags: ServingFlags | None = None  # the flags before (inp.current)
    handled: tuple[str, ...] = ()  # termination keys this decision accounts for
    retry_after: float | None = None  # seconds until a held action may go ahead
    held_action: str | None = None  # for "hold": what would have been done

    @property
    def changes_flags(self) -> bool:
        return self.flags != self.from_flags

    @property
    def is_remediation(self) -> bool:
        """A flag change rankguard made on its own (goes into the history, counts for cooldown)."""
        return self.changes_flags and self.action not in ("initial", "hold", "none")

    def remediation(self, time: float, revision: str | int | None = None) -> Remediation:
        return Remediation(
            time=time,
            trigger=self.trigger,
            action=self.action,
            rank=self.rank,
            from_flags=self.from_flags,
            to_flags=self.flags,
            revision=revision,
            message=self.message,
        )


# --------------------------------------------------------------------------------------------
# Trackers the caller keeps between calls (pure: previous value in, next value out)


def track_low_headroom(
    prev_since: float | None, observation: Observation | None, spec: ServiceSpec, now: float
) -> float | None:
    """Since when the bottleneck has been below spec.memory.minHeadroomBytes. Stale or missing
    data neither starts nor ends the stretch (it is kept as it was)."""
    b = observation.bottleneck if observation is not None else None
    if b is None:
        return prev_since
    if b.min_free_bytes < spec.memory.min_headroom_bytes:
        return prev_since if prev_since is not None else now
    return None


def track_ample_headroom(
    prev_since: float | None, observation: Observation | None, spec: ServiceSpec, now: float
) -> float | None:
    """Since when every fresh rank has had >= RECLAIM_HEADROOM_FACTOR × minHeadroomBytes."""
    if observation is None or not observation.has_fresh_data:
        return prev_since
    threshold = RECLAIM_HEADROOM_FACTOR * spec.memory.min_headroom_bytes
    if all(r.min_free_bytes >= threshold for r in observation.fresh_ranks):
        return prev_since if prev_since is not None else now
    return None


def next_last_known_good(
    prev: ServingFlags | None,
    current: ServingFlags | None,
    *,
    spec: ServiceSpec,
    rollout: RolloutState | None,
    observation: Observation | None,
    terminations: Sequence[Termination] = (),
) -> ServingFlags | None:
    """`current` becomes last-known-good once it has fully rolled out, fresh reports show every
    rank at or above the minimum headroom, and no memory or engine failure ran under it."""
    if current is None or rollout is None or not rollout.complete:
        return prev
    if observation is None:
        return prev
    b = observation.bottleneck
    if b is None or b.min_free_bytes < spec.memory.min_headroom_bytes:
        return prev
    for t in terminations:
        if t.kind in (CUDA_OOM, KV_CACHE_TOO_SMALL, OOM_KILLED, ENGINE_ERROR) and (
            t.flags is None or t.flags == current
        ):
            return prev
    return current


# --------------------------------------------------------------------------------------------
# Helpers


def _same_budget(a: ServingFlags, b: ServingFlags) -> bool:
    return (
        a.kv_cache_memory_bytes == b.kv_cache_memory_bytes
        and a.gpu_memory_utilization == b.gpu_memory_utilization
    )


def _superseded(t: Termination, current: ServingFlags) -> bool:
    """The pod ran other flags than the current ones in the dimension this failure is about."""
    if t.flags is None:
        return False
    if t.kind == OOM_KILLED:
        return t.flags.memory_limit_bytes != current.memory_limit_bytes
    return not _same_budget(t.flags, current)


def _rank_text(rank: int | None) -> str:
    return f"rank {rank}" if rank is not None else "a rank"


def _decision(
    inp: PolicyInput,
    action: Action,
    flags: ServingFlags,
    *,
    trigger: str,
    reason: str,
    message: str,
    rank: int | None = None,
    handled: Sequence[str] = (),
) -> Decision:
    return Decision(
        action=action,
        flags=flags,
        trigger=trigger,
        reason=reason,
        message=message,
        rank=rank,
        from_flags=inp.current,
        handled=tuple(handled),
    )


def _effective_budget(inp: PolicyInput, t: Termination | None, rank: int | None) -> tuple[int, str] | None:
    """The byte budget in effect when the flags say only a utilisation (see rule 1)."""
    cur = inp.current
    assert cur is not None
    if cur.kv_cache_memory_bytes is not None:
        return cur.kv_cache_memory_bytes, f"the KV budget {_b(cur.kv_cache_memory_bytes)}"
    if t is not None and t.kv_cache_bytes:
        return t.kv_cache_bytes, f"the {_b(t.kv_cache_bytes)} of KV cache vLLM reported in that run"
    obs = inp.observation
    if obs is not None and obs.has_fresh_data and obs.kv_cache_bytes:
        return obs.kv_cache_bytes, f"the {_b(obs.kv_cache_bytes)} of KV cache vLLM reports"
    util = cur.gpu_memory_utilization
    if inp.plan is not None and util is not None:
        kv = utilization_kv_bytes(inp.plan, util, rank)
        if kv > 0:
            return kv, (
                f"the {_b(kv)} of KV cache that gpu-memory-utilization {util:g} leaves on "
                f"{_rank_text(rank)} by the plan's non-KV estimate"
            )
    return None


def _budget_change(
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
    unit = block_unit(plan)
    floor = kv_floor(spec, plan)
    target = round_down(target, unit)
    if action == "shrink" and cur.kv_cache_memory_bytes is not None:
        target = min(target, cur.kv_cache_memory_bytes - unit)  # a shrink always shrinks
    ceiling = spec.remediation.max_kv_cache_bytes
    if ceiling is not None:
        target = min(target, ceiling)
    if target < floor:
        floor_why = _floor_reason(spec, plan, floor)
        if cur.kv_cache_memory_bytes is None or cur.kv_cache_memory_bytes > floor:
            flags = cur.with_kv(floor)
            did = f"rankguard sets the floor {_b(floor)} and reports the service Degraded"
        else:
            flags = cur
            did = f"the budget is already at the floor {_b(floor)}; the service is Degraded"
        return _decision(
            inp,
            "degrade",
            flags,
            trigger=trigger,
            reason="BudgetAtFloor",
            message=(
                f"{why}; the KV budget would have to drop to {_b(max(target, 0))}, below the floor "
                f"{_b(floor)} ({floor_why}); {did}. To fix: {_KNOBS}"
            ),
            rank=rank,
            handled=handled,
        )
    verb = {"shrink": "shrinking", "grow": "growing", "replan": "setting"}.get(action, "setting")
    return _decision(
        inp,
        action,
        cur.with_kv(target),
        trigger=trigger,
        reason={"shrink": "ShrankKVCache", "grow": "GrewKVCache"}.get(action, "Replanned"),
        message=f"{why}; {verb} the per-GPU KV budget from {_b(base)} to {_b(target)}{how}",
        rank=rank,
        handled=handled,
    )


def _util_base(plan: Plan, cur: ServingFlags) -> int:
    """What the current utilisation gives by the plan's estimate (the "from" of a replan)."""
    u = cur.gpu_memory_utilization
    return utilization_kv_bytes(plan, u) if u is not None else plan.utilization_kv_bytes


def _floor_reason(spec: ServiceSpec, plan: Plan | None, floor: int) -> str:
    parts = []
    if plan is not None and plan.min_kv_cache_memory_bytes == floor:
        parts.append(f"one request of maxModelLen {plan.max_model_len} tokens")
    if spec.remediation.min_kv_cache_bytes == floor:
        parts.append("spec.remediation.minKVCacheBytes")
    return " and ".join(parts) or "one KV block"


# --------------------------------------------------------------------------------------------
# Rule 0: initial


def _initial(inp: PolicyInput, trigger: str) -> Decision:
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
        return _decision(
            inp,
            "initial",
            ServingFlags(kv_cache_memory_bytes=m.kv_cache_memory_bytes, memory_limit_bytes=limit),
            trigger=trigger,
            reason="BudgetPinned",
            message=f"{lead}the per-GPU KV budget is pinned at {_b(m.kv_cache_memory_bytes)} by "
            "spec.memory.kvCacheMemoryBytes; rankguard measures every rank but never changes a pinned "
            "budget (it still raises the memory limit after an OOMKill)",
            handled=handled,
        )
    if m.gpu_memory_utilization is not None:
        return _decision(
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
        return _decision(
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
        capped = f", capped at spec.remediation.maxKVCacheBytes {_b(ceiling)}"
    source = "the probe's measurements" if is_measured(plan) else "priors"
    b = plan.ranks[plan.bottleneck_rank]
    if target < floor:
        return _decision(
            inp,
            "degrade",
            ServingFlags(kv_cache_memory_bytes=floor, memory_limit_bytes=limit),
            trigger=T_FLOOR,
            reason="BudgetBelowFloor",
            message=(
                f"{lead}the planned per-GPU KV budget {_b(target)} (from {source}; rank {b.rank} is the "
                f"bottleneck) is below the floor {_b(floor)} ({_floor_reason(spec, plan, floor)}); starting "
                f"at the floor, which may not fit. To fix: {_KNOBS}"
            ),
            rank=b.rank,
            handled=handled,
        )
    return _decision(
        inp,
        "initial",
        ServingFlags(kv_cache_memory_bytes=target, memory_limit_bytes=limit),
        trigger=trigger,
        reason="BudgetPlanned",
        message=(
            f"{lead}planned a per-GPU KV budget of {_b(target)} from {source}{capped}: rank {b.rank} is the "
            f"bottleneck (non-KV {_b(b.non_kv_bytes)} of {_b(b.total_bytes)}, "
            f"{_b(spec.memory.safety_margin_bytes)} safety margin); {plan.kv_tokens:,} tokens, max "
            f"concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens"
        ),
        rank=b.rank,
        handled=handled,
    )


# --------------------------------------------------------------------------------------------
# Rules 1-9. Each returns a Decision or None (does not apply).


def _rule_cuda_oom(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ooms = [t for t in rel if t.kind == CUDA_OOM]
    if not ooms:
        return None
    cur = inp.current
    assert cur is not None
    keys = [t.key for t in ooms]
    # the worst failure decides: the largest stated deficit, else the first
    worst = max(ooms, key=lambda t: -1 if t.deficit_bytes is None else t.deficit_bytes)
    what = f"{_rank_text(worst.rank)} ran out of GPU memory in pod {worst.pod_name}"
    if worst.requested_bytes is not None and worst.free_bytes is not None:
        what += f" (tried to allocate {_b(worst.requested_bytes)} with {_b(worst.free_bytes)} free)"
    margin = inp.spec.memory.safety_margin_bytes
    if inp.spec.memory.pinned:
        need = (worst.deficit_bytes or 0) + margin
        return _decision(
            inp,
            "degrade",
            cur,
            trigger=T_CUDA_OOM,
            reason="PinnedBudgetOOM",
            message=f"{what} under the pinned KV budget {cur.budget_text()}; rankguard never changes "
            f"spec.memory.kvCacheMemoryBytes: lower it by at least {_b(need)}, or remove it to let rankguard "
            "manage the budget",
            rank=worst.rank,
            handled=keys,
        )
    eff = _effective_budget(inp, worst, worst.rank)
    if eff is None:
        return _decision(
            inp,
            "degrade",
            cur,
            trigger=T_CUDA_OOM,
            reason="NoBudgetToConvert",
            message=(
                f"{what} under {cur.describe()}, and rankguard cannot tell the KV budget that was in effect; "
                "set spec.memory.gpuMemoryBytes (so rankguard can plan) or spec.memory.kvCacheMemoryBytes"
            ),
            rank=worst.rank,
            handled=keys,
        )
    base, base_text = eff
    deficit = worst.deficit_bytes
    if deficit is None:
        deficit = max(UNKNOWN_DEFICIT_MIN_BYTES, int(base * UNKNOWN_DEFICIT_FRACTION))
        how = f" (the message gave no figures: {_b(deficit)} assumed, plus the {_b(margin)} safety margin)"
    else:
        how = f" (deficit {_b(deficit)} plus the {_b(margin)} safety margin)"
    if cur.kv_cache_memory_bytes is None:
        how += f"; switching from gpu-memory-utilization to bytes, starting from {base_text}"
    return _budget_change(
        inp,
        "shrink",
        base - deficit - margin,
        base,
        trigger=T_CUDA_OOM,
        why=what,
        rank=worst.rank,
        handled=keys,
        how=how,
    )


def _rule_kv_too_small(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ts = [t for t in rel if t.kind == KV_CACHE_TOO_SMALL]
    if not ts:
        return None
    cur, spec, plan = inp.current, inp.spec, inp.plan
    assert cur is not None
    t = ts[0]
    keys = [x.key for x in ts]
    floor = kv_floor(spec, plan)
    what = (
        f"vLLM refused to start in pod {t.pod_name}: the KV budget ({cur.describe()}) cannot hold one "
        "request of maxModelLen"
    )
    if (
        cur.kv_cache_memory_bytes is None
        and not spec.memory.pinned
        and plan is not None
        and plan.kv_cache_memory_bytes >= floor
    ):
        return _budget_change(
            inp,
            "replan",
            plan.kv_cache_memory_bytes,
            _util_base(plan, cur),
            trigger=T_KV_TOO_SMALL,
            why=what,
            rank=plan.bottleneck_rank,
            handled=keys,
            how=" (the planned explicit budget, which fits one request)",
        )
    pinned = " or raise spec.memory.kvCacheMemoryBytes" if spec.memory.pinned else ""
    return _decision(
        inp,
        "degrade",
        cur,
        trigger=T_KV_TOO_SMALL,
        reason="KVCacheTooSmall",
        message=f"{what} (rankguard's floor is {_b(floor)}); to fix: {_KNOBS}{pinned}",
        rank=t.rank,
        handled=keys,
    )


def _rule_oom_killed(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ks = [t for t in rel if t.kind == OOM_KILLED]
    if not ks:
        return None
    cur, spec = inp.current, inp.spec
    assert cur is not None
    keys = [t.key for t in ks]
    t = ks[0]
    old = cur.memory_limit_bytes if cur.memory_limit_bytes is not None else spec.resources.memory_limit_bytes
    if old is None:
        return _decision(
            inp,
            "degrade",
            cur,
            trigger=T_OOM_KILLED,
            reason="NoMemoryLimit",
            message=(
                f"pod {t.pod_name} was OOMKilled without a container memory limit, so the node itself ran "
                "out of memory; set spec.resources.requests.memory and spec.resources.limits.memory so the "
                "scheduler reserves enough host memory"
            ),
            handled=keys,
        )
    ratio = spec.remediation.host_memory_bump_ratio
    bumped = max(old + VPA_MIN_BUMP_BYTES, math.ceil(old * ratio))
    new = -(-bumped // MiB) * MiB  # whole MiB: a readable quantity
    caps = [(c, n) for c, n in (
        (spec.remediation.max_host_memory_bytes, "spec.remediation.maxHostMemory"),
        (inp.node_memory_bytes, "the node's allocatable memory"),
    ) if c is not None]  # fmt: skip
    cap_note = ""
    if caps:
        cap, cap_name = min(caps, key=lambda c: c[0])
        if old >= cap:
            return _decision(
                inp,
                "degrade",
                cur,
                trigger=T_OOM_KILLED,
                reason="MemoryLimitAtCap",
                message=(
                    f"pod {t.pod_name} was OOMKilled at the container memory limit {_b(old)}, which is "
                    f"already at the cap {_b(cap)} ({cap_name}); raise spec.remediation.maxHostMemory (on "
                    "nodes with more memory), or lower host-memory use (spec.engine.maxNumSeqs, fewer "
                    "CPU-side caches)"
                ),
                handled=keys,
            )
        if new > cap:
            new, cap_note = cap, f", capped at {_b(cap)} ({cap_name})"
    return _decision(
        inp,
        "raise-memory-limit",
        cur.with_memory_limit(new),
        trigger=T_OOM_KILLED,
        reason="RaisedMemoryLimit",
        message=(
            f"pod {t.pod_name} was OOMKilled at the container memory limit {_b(old)}; raising it to "
            f"{_b(new)} (max(+100Mi, ×{ratio:g}), as the VPA does{cap_note})"
        ),
        handled=keys,
    )


def _rule_rollout_failed(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    r = inp.rollout
    if r is None or not r.failed:
        return None
    cur, lkg = inp.current, inp.last_known_good
    assert cur is not None
    what = f"the rollout of {cur.describe()} did not finish ({r.reason}: {r.message})"
    if lkg is not None and lkg != cur:
        return _decision(
            inp,
            "rollback",
            lkg,
            trigger=T_ROLLOUT_FAILED,
            reason="RolledBack",
            message=f"{what}; rolling back to the last known good flags: {lkg.describe()}",
        )
    return _decision(
        inp,
        "degrade",
        cur,
        trigger=T_ROLLOUT_FAILED,
        reason="RolloutFailed",
        message=(
            f"{what}, and there are no other known-good flags to roll back to; this is not a memory problem "
            "rankguard can fix: check the pods' events and logs (image, scheduling, GPUs, engine errors)"
        ),
    )


def _last(history: Sequence[Remediation]) -> Remediation | None:
    return max(history, key=lambda h: h.time) if history else None


def _engine_error_actionable(inp: PolicyInput, t: Termination) -> bool:
    """An engine error that a rollback may fix: flags changed since last-known-good, and the
    error happened after the latest change."""
    cur, lkg = inp.current, inp.last_known_good
    if lkg is None or lkg == cur:
        return False
    last = _last(inp.history)
    return last is None or t.finished_at is None or t.finished_at >= last.time


def _rule_engine_error(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, lkg = inp.current, inp.last_known_good
    assert cur is not None
    errs = [t for t in rel if t.kind == ENGINE_ERROR and _engine_error_actionable(inp, t)]
    if not errs or lkg is None:
        return None
    t = errs[0]
    return _decision(
        inp,
        "rollback",
        lkg,
        trigger=T_ENGINE_ERROR,
        reason="RolledBack",
        message=(
            f"vLLM exited with an engine error in pod {t.pod_name} (exit code {t.exit_code}: "
            f"{t.message[:200]}) after the change to {cur.describe()}; rolling back to the last known good "
            f"flags: {lkg.describe()}"
        ),
        rank=t.rank,
        handled=[x.key for x in errs],
    )


def _rule_headroom_worse(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    last = _last(inp.history)
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
    if before is None or _same_budget(before, cur):
        return None
    target = replace(before, memory_limit_bytes=cur.memory_limit_bytes)
    return _decision(
        inp,
        "rollback",
        target,
        trigger=T_HEADROOM_WORSE,
        reason="RolledBack",
        message=(
            f"after growing the KV budget from {before.budget_text()} to {cur.budget_text()}, rank "
            f"{b.rank}'s headroom fell to {_b(b.min_free_bytes)}, below the minimum "
            f"{_b(spec.memory.min_headroom_bytes)}; rolling back to {before.budget_text()}"
        ),
        rank=b.rank,
    )


def _rule_low_headroom(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
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
        f"rank {b.rank} has kept only {_b(b.min_free_bytes)} of GPU memory free (pod {b.pod}), below the "
        f"minimum headroom {_b(minimum)}, for {lasted:.0f}s"
    )
    deficit = minimum - b.min_free_bytes
    margin = spec.memory.safety_margin_bytes
    if spec.memory.pinned:
        return replace(
            _decision(
                inp,
                "hold",
                cur,
                trigger=T_LOW_HEADROOM,
                reason="PinnedBudget",
                message=(
                    f"{what}; the KV budget is pinned (spec.memory.kvCacheMemoryBytes), so rankguard does "
                    f"not shrink it: lower it by at least {_b(deficit + margin)} before rank {b.rank} runs "
                    "out"
                ),
                rank=b.rank,
            ),
            held_action="shrink",
        )
    eff = _effective_budget(inp, None, b.rank)
    if eff is None:
        return None  # utilisation mode with nothing to convert from: the OOM rule will speak up
    base, base_text = eff
    how = f" (headroom deficit {_b(deficit)} plus the {_b(margin)} safety margin)"
    if cur.kv_cache_memory_bytes is None:
        how += f"; switching from gpu-memory-utilization to bytes, starting from {base_text}"
    return _budget_change(
        inp, "shrink", base - deficit - margin, base, trigger=T_LOW_HEADROOM, why=what, rank=b.rank, how=how
    )


def _rule_replan(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, spec, plan = inp.current, inp.spec, inp.plan
    assert cur is not None
    if plan is None or spec.memory.pinned or spec.memory.gpu_memory_utilization is not None:
        return None
    trigger = T_MEASURED if is_measured(plan) else T_PLANNED
    if cur.kv_cache_memory_bytes is None:
        gpu = min(r.total_bytes for r in plan.ranks)
        return _budget_change(
            inp,
            "replan",
            plan.kv_cache_memory_bytes,
            _util_base(plan, cur),
            trigger=trigger,
            why=(
                f"one GPU's memory is now known ({_b(gpu)}) and rank {plan.bottleneck_rank} is the bottleneck"
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
    return _budget_change(
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


def _bad_budget_cap(inp: PolicyInput, unit: int) -> int | None:
    """For a day after a crash or regression, growing stops at the budget that fixed it; after
    a pressure shrink, one block below the budget that was under pressure."""
    caps = []
    for h in inp.history:
        if inp.now - h.time > BAD_BUDGET_MEMORY_SECONDS:
            continue
        if h.trigger in (T_CUDA_OOM, T_HEADROOM_WORSE) and h.to_flags.kv_cache_memory_bytes is not None:
            caps.append(h.to_flags.kv_cache_memory_bytes)
        elif h.trigger == T_LOW_HEADROOM and h.from_flags is not None and h.from_flags.kv_cache_memory_bytes:
            caps.append(h.from_flags.kv_cache_memory_bytes - unit)
    return min(caps) if caps else None


def _rule_reclaim(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, spec, obs = inp.current, inp.spec, inp.observation
    assert cur is not None
    kv = cur.kv_cache_memory_bytes
    if not spec.memory.reclaim or spec.memory.pinned or kv is None:
        return None
    since = inp.ample_headroom_since
    if since is None or inp.now - since < RECLAIM_AFTER_SECONDS:
        return None
    last = _last(inp.history)
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
    unit = block_unit(inp.plan)
    ceiling = kv_ceiling(spec, inp.plan)
    bad = _bad_budget_cap(inp, unit)
    if bad is not None:
        ceiling = bad if ceiling is None else min(ceiling, bad)
    if ceiling is None:
        return None  # no plan and no spec.remediation.maxKVCacheBytes: never grow blind
    margin = spec.memory.safety_margin_bytes
    step = round_down((b.min_free_bytes - margin) // 2, unit)
    target = min(kv + step, ceiling)
    if target - kv < max(MIN_CHANGE_BYTES, unit):
        return None
    capped = f", capped at {_b(ceiling)}" if target == ceiling and kv + step > ceiling else ""
    return _budget_change(
        inp,
        "grow",
        target,
        kv,
        trigger=T_RECLAIM,
        why=f"every rank has kept at least {_b(threshold)} free for {(inp.now - since) / 60:.0f} min "
        f"(bottleneck rank {b.rank}: {_b(b.min_free_bytes)})",
        rank=b.rank,
        how=f" (half the bottleneck's {_b(b.min_free_bytes - margin)} above the safety margin{capped})",
    )


# --------------------------------------------------------------------------------------------
# Guard rails


def _hold(
    inp: PolicyInput, d: Decision, *, trigger: str, reason: str, why: str, retry: float | None
) -> Decision:
    return Decision(
        action="hold",
        flags=d.from_flags if d.from_flags is not None else d.flags,
        trigger=trigger,
        reason=reason,
        message=f"{why}; held: {d.message}",
        rank=d.rank,
        from_flags=d.from_flags,
        handled=(),
        retry_after=retry,
        held_action=d.action,
    )


def _guard(inp: PolicyInput, d: Decision) -> Decision:
    if not d.changes_flags or d.action == "initial":
        return d
    rem = inp.spec.remediation
    if not rem.enabled:
        return _hold(
            inp,
            d,
            trigger=T_DISABLED,
            reason="RemediationDisabled",
            why="automatic remediation is off (spec.remediation.enabled: false), so rankguard only reports",
            retry=None,
        )
    if d.action == "rollback":
        return d  # returning to known flags is always allowed
    last = _last(inp.history)
    # A crash under the very flags our last change produced means that change is failing now:
    # fixing it is not flapping, and the service is down meanwhile, so the cooldown does not
    # apply. The hourly limit still does.
    fixes_last_change = (
        d.trigger in (T_CUDA_OOM, T_OOM_KILLED) and last is not None and last.to_flags == inp.current
    )
    if last is not None and not fixes_last_change and inp.now - last.time < rem.cooldown_seconds:
        wait = last.time + rem.cooldown_seconds - inp.now
        return _hold(
            inp,
            d,
            trigger=T_COOLDOWN,
            reason="CooldownActive",
            why=(
                f"the last change was {inp.now - last.time:.0f}s ago, within the {rem.cooldown_seconds}s "
                f"cooldown (spec.remediation.cooldownSeconds); retrying in {wait:.0f}s"
            ),
            retry=wait,
        )
    recent = [h for h in inp.history if inp.now - h.time < RATE_WINDOW_SECONDS]
    if len(recent) >= rem.max_per_hour:
        wait = min(h.time for h in recent) + RATE_WINDOW_SECONDS - inp.now if recent else RATE_WINDOW_SECONDS
        return _hold(
            inp,
            d,
            trigger=T_RATE_LIMIT,
            reason="RateLimited",
            why=(
                f"{len(recent)} changes in the last hour reach spec.remediation.maxPerHour "
                f"({rem.max_per_hour}); retrying in {wait:.0f}s"
            ),
            retry=wait,
        )
    return d


# --------------------------------------------------------------------------------------------
# decide


def _steady(inp: PolicyInput) -> Decision:
    cur = inp.current
    assert cur is not None
    obs = inp.observation
    b = obs.bottleneck if obs is not None else None
    minimum = inp.spec.memory.min_headroom_bytes
    if b is None:
        return _decision(
            inp,
            "none",
            cur,
            trigger="NoData",
            reason="NoFreshData",
            message=f"no fresh agent report; running {cur.describe()}",
        )
    if b.min_free_bytes < minimum and inp.low_headroom_since is not None:
        return _decision(
            inp,
            "none",
            cur,
            trigger=T_LOW_HEADROOM,
            reason="LowHeadroom",
            message=f"rank {b.rank} has {_b(b.min_free_bytes)} headroom, below the minimum {_b(minimum)} for "
            f"{inp.now - inp.low_headroom_since:.0f}s; rankguard shrinks after "
            f"{LOW_HEADROOM_SUSTAIN_SECONDS:.0f}s",
            rank=b.rank,
        )
    return _decision(
        inp,
        "none",
        cur,
        trigger="Steady",
        reason="Stable",
        message=f"running {cur.describe()}; bottleneck rank {b.rank} has {_b(b.min_free_bytes)} headroom "
        f"(minimum {_b(minimum)})",
        rank=b.rank,
    )


_RULES: tuple[Callable[[PolicyInput, Sequence[Termination]], Decision | None], ...] = (
    _rule_cuda_oom,
    _rule_kv_too_small,
    _rule_oom_killed,
    _rule_rollout_failed,
    _rule_engine_error,
    _rule_headroom_worse,
    _rule_low_headroom,
    _rule_replan,
    _rule_reclaim,
)


def decide(inp: PolicyInput) -> Decision:
    """The one decision for this moment. Deterministic; see the module docstring for the rules."""
    cur = inp.current
    if cur is None:
        return _initial(inp, T_INITIAL)
    if inp.budget_key is not None and inp.budget_key != budget_key(inp.spec):
        return _initial(inp, T_SPEC_CHANGED)

    superseded = [t.key for t in inp.new_terminations if _superseded(t, cur)]
    rel = [t for t in inp.new_terminations if not _superseded(t, cur)]
    actionable_kinds = (CUDA_OOM, KV_CACHE_TOO_SMALL, OOM_KILLED, ENGINE_ERROR)
    # Normal stops (rollouts, scale-down) are only recorded as seen, and so are engine errors
    # that no rollback can fix (nothing changed since the flags were known good, or the error
    # came before the latest change).
    ignorable = [
        t.key
        for t in rel
        if t.kind not in actionable_kinds or (t.kind == ENGINE_ERROR and not _engine_error_actionable(inp, t))
    ]

    decision: Decision | None = None
    for rule in _RULES:
        decision = rule(inp, rel)
        if decision is not None:
            break
    if decision is None:
        decision = _steady(inp)
    decision = _guard(inp, decision)
    handled = tuple(dict.fromkeys([*superseded, *ignorable, *decision.handled]))
    return replace(decision, handled=handled)


def initial_plan(
    spec: ServiceSpec,
    observation: Observation | None = None,
    *,
    shape: ModelShape | None = None,
    hf_config: Mapping[str, Any] | None = None,
) -> Plan | None:
    """The plan to pass as `PolicyInput.plan`: the planner's budget for `spec`, with each fresh
    rank's measured total and probe figures (from `observation`) replacing the priors. None
    while one GPU's size is unknown. Raises SpecError when the spec cannot be planned."""
    return budget_plan(spec, measured=gpu_totals(observation), shape=shape, hf_config=hf_config)
