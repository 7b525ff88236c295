"""The policy, rule by rule and guard rail by guard rail, with the budget bounds it relies on.

Setting: Llama-3-70B, TP 4, 80 GiB GPUs, max_model_len 8192, container memory limit 64Gi. Its
prior plan gives a 38 GiB per-GPU budget in KV blocks of 1.25 MiB (UNIT); one request at
max_model_len needs 640 MiB, plus the block vLLM 0.33 holds back (the floor).

(Over 450 lines because every rule and guard rail is tested against the same setting and the
same bounds; one file keeps the numbers they share in one place.)
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.budget.bounds import (
    block_unit,
    budget_key,
    initial_plan,
    kv_ceiling,
    kv_floor,
    round_down,
    utilization_kv_bytes,
)
from rankguard_operator.core.budget.planner import Plan, RankMeasurement
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation, RankHeadroom
from rankguard_operator.core.observe.pods import RolloutState, Termination
from rankguard_operator.core.policy import (
    Decision,
    PolicyInput,
    decide,
    next_last_known_good,
    track_ample_headroom,
    track_low_headroom,
)
from rankguard_operator.core.policy.history import Remediation
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.units import GiB, MiB

DOC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-70B"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 4,
    "engine": {"maxModelLen": 8192},
    "memory": {"gpuMemoryBytes": 80 * GiB},
    "resources": {"limits": {"memory": "64Gi"}},
}


def spec_with(**sections: dict[str, Any]) -> ServiceSpec:
    doc = copy.deepcopy(DOC)
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    return parse_spec(doc)


SPEC = parse_spec(DOC)


def _must(plan: Plan | None) -> Plan:
    assert plan is not None
    return plan


PLAN = _must(initial_plan(SPEC))
UNIT = block_unit(PLAN)
KV = PLAN.kv_cache_memory_bytes
FLOOR = kv_floor(SPEC, PLAN)
MARGIN = 512 * MiB
MINH = 256 * MiB
CUR = ServingFlags(kv_cache_memory_bytes=KV)
LKG = ServingFlags(kv_cache_memory_bytes=KV - 2 * GiB)
NOW = 1_800_000_000.0
COMPLETE = RolloutState("complete", 1, 1, 1, 1, True, True, "Complete")
PROGRESSING = RolloutState("progressing", 1, 0, 0, 0, True, True, "Progressing", "0 of 1 replicas updated")
FAILED = RolloutState("failed", 1, 0, 0, 0, True, True, "ProgressDeadlineExceeded", "timed out progressing")


def test_the_setting() -> None:
    # the floor is one 8192-token request (512 blocks) plus vLLM 0.33's null block
    assert (40_832_860_160, 1_310_720, 640 * MiB + 1_310_720) == (KV, UNIT, FLOOR)
    assert KV % UNIT == 0


def obs(*min_free: int, stale: bool = False, kv_cache_bytes: int | None = None) -> Observation:
    return Observation(
        now=NOW,
        ranks=tuple(
            RankHeadroom(
                rank=i,
                uuid=f"GPU-{i}",
                pod="llama-0",
                total_bytes=80 * GiB,
                free_bytes=m,
                min_free_bytes=m,
                stale=stale,
            )
            for i, m in enumerate(min_free)
        ),
        fresh_pods=() if stale else ("llama-0",),
        stale_pods=("llama-0",) if stale else (),
        kv_cache_bytes=kv_cache_bytes,
    )


HEALTHY = obs(2 * GiB, 3 * GiB, 3 * GiB, 3 * GiB)
_counter = iter(range(10_000))


def term(
    kind: str = "CUDAOutOfMemory",
    *,
    rank: int | None = 2,
    requested: int | None = 2 * GiB,
    free: int | None = 512 * MiB,
    flags: ServingFlags | None = CUR,
    finished_at: float = NOW - 10,
    kv_cache_bytes: int | None = None,
    exit_code: int = 1,
) -> Termination:
    n = next(_counter)
    return Termination(
        pod_name="llama-0",
        pod_uid=f"uid-{n}",
        container="vllm",
        restart_count=0,
        kind=kind,  # type: ignore[arg-type]
        exit_code=exit_code,
        rank=rank,
        requested_bytes=requested,
        free_bytes=free,
        total_bytes=80 * GiB,
        finished_at=finished_at,
        message="CUDA out of memory" if kind == "CUDAOutOfMemory" else kind,
        kv_cache_bytes=kv_cache_bytes,
        flags=flags,
    )


def past(
    age: float,
    *,
    trigger: str = "CUDAOutOfMemory",
    action: str = "shrink",
    frm: int | None = KV + 2 * GiB,
    to: int = KV,
) -> Remediation:
    return Remediation(
        time=NOW - age,
        trigger=trigger,
        action=action,
        rank=0,
        from_flags=None if frm is None else ServingFlags(kv_cache_memory_bytes=frm),
        to_flags=ServingFlags(kv_cache_memory_bytes=to),
    )


def inp(**kw: Any) -> PolicyInput:
    args: dict[str, Any] = {"spec": SPEC, "now": NOW, "current": CUR, "plan": PLAN, "observation": HEALTHY}
    args.update(kw)
    return PolicyInput(**args)


# --- rule 0: the first budget -------------------------------------------------------------------


def test_initial_from_the_prior_plan() -> None:
    d = decide(inp(current=None, observation=None))
    assert (d.action, d.trigger, d.reason, d.rank) == ("initial", "Initial", "BudgetPlanned", 0)
    assert d.flags == ServingFlags(kv_cache_memory_bytes=KV)
    assert d.changes_flags and not d.is_remediation
    assert "38Gi from priors" in d.message and "rank 0 is the bottleneck" in d.message


def test_initial_from_probe_figures() -> None:
    measured = [RankMeasurement(r, total_bytes=80 * GiB, free_after_init_bytes=75 * GiB) for r in range(4)]
    plan = initial_plan(SPEC, measured=measured)
    assert plan is not None
    d = decide(inp(current=None, plan=plan))
    assert d.flags.kv_cache_memory_bytes == plan.kv_cache_memory_bytes != KV
    assert "from the probe's measurements" in d.message


def test_initial_pinned_is_never_remediated() -> None:
    s = spec_with(memory={"kvCacheMemoryBytes": 30 * GiB})
    d = decide(inp(spec=s, current=None))
    assert (d.action, d.reason, d.flags) == (
        "initial",
        "BudgetPinned",
        ServingFlags(kv_cache_memory_bytes=30 * GiB),
    )
    assert "never changes a pinned budget" in d.message


def test_initial_utilisation_and_no_plan() -> None:
    s = spec_with(memory={"gpuMemoryUtilization": 0.85})
    d = decide(inp(spec=s, current=None))
    assert (d.reason, d.flags) == ("UtilizationStart", ServingFlags(gpu_memory_utilization=0.85))
    assert "first CUDA OOM switches" in d.message
    d2 = decide(inp(current=None, plan=None))
    assert (d2.reason, d2.flags) == ("AwaitingMeasurement", ServingFlags(gpu_memory_utilization=0.9))
    assert "spec.memory.gpuMemoryBytes" in d2.message


def test_initial_capped_by_the_ceiling_and_degraded_below_the_floor() -> None:
    capped = decide(inp(spec=spec_with(remediation={"maxKVCacheBytes": 20 * GiB}), current=None))
    assert capped.action == "initial" and capped.flags.kv_cache_memory_bytes == round_down(20 * GiB, UNIT)
    assert "capped at spec.remediation.maxKVCacheBytes 20Gi" in capped.message
    s = spec_with(remediation={"minKVCacheBytes": 50 * GiB})
    low = decide(inp(spec=s, current=None))
    assert (low.action, low.trigger, low.reason) == ("degrade", "Floor", "BudgetBelowFloor")
    assert low.flags.kv_cache_memory_bytes == 50 * GiB
    assert "lower spec.engine.maxModelLen" in low.message


def test_spec_change_replans_and_keeps_a_raised_memory_limit() -> None:
    raised = replace(CUR, kv_cache_memory_bytes=KV - 4 * GiB, memory_limit_bytes=80 * GiB)
    stale_key = budget_key(spec_with(engine={"maxNumSeqs": 128}))
    d = decide(inp(current=raised, budget_key=stale_key, new_terminations=[term()]))
    assert (d.action, d.trigger) == ("initial", "SpecChanged")
    assert d.flags == ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=80 * GiB)
    assert len(d.handled) == 1  # terminations under the old spec are settled by the re-plan
    bigger = spec_with(resources={"limits": {"memory": "96Gi"}})
    d2 = decide(inp(spec=bigger, current=raised, budget_key=stale_key))
    assert d2.flags.memory_limit_bytes is None  # the spec now asks for more than the bump
    assert decide(inp(budget_key=budget_key(SPEC))).action == "none"


# --- rule 1: CUDA OOM ----------------------------------------------------------------------------


def test_cuda_oom_shrinks_by_the_deficit_plus_margin() -> None:
    t = term(rank=2, requested=2 * GiB, free=512 * MiB)
    d = decide(inp(new_terminations=[t]))
    # 2 GiB − 512 MiB deficit + 512 MiB margin = 2 GiB = 1638.4 blocks -> 1639 blocks less
    assert (d.action, d.trigger, d.reason, d.rank) == ("shrink", "CUDAOutOfMemory", "ShrinkKVCache", 2)
    assert d.flags == ServingFlags(kv_cache_memory_bytes=KV - 1639 * UNIT)
    assert d.handled == (t.key,) and d.is_remediation and d.from_flags == CUR
    assert d.message == (
        "rank 2 ran out of GPU memory in pod llama-0 (tried to allocate 2Gi with 512Mi free); shrinking "
        "the per-GPU KV budget from 38Gi to 36Gi (deficit 1.5Gi plus the 512Mi safety margin)"
    )


def test_the_worst_of_several_ooms_decides() -> None:
    small = term(rank=0, requested=600 * MiB, free=500 * MiB)
    big = term(rank=3, requested=3 * GiB, free=100 * MiB)
    d = decide(inp(new_terminations=[small, big]))
    assert d.rank == 3 and set(d.handled) == {small.key, big.key}
    assert d.flags.kv_cache_memory_bytes == round_down(KV - (3 * GiB - 100 * MiB) - MARGIN, UNIT)


def test_oom_without_figures_assumes_five_percent() -> None:
    d = decide(inp(new_terminations=[term(requested=None, free=None)]))
    assert d.flags.kv_cache_memory_bytes == round_down(KV - int(KV * 0.05) - MARGIN, UNIT)
    assert "the message gave no figures: 1.9Gi assumed" in d.message
    tiny = ServingFlags(kv_cache_memory_bytes=2 * GiB)
    d2 = decide(inp(current=tiny, new_terminations=[term(requested=None, free=None, flags=tiny)]))
    assert d2.flags.kv_cache_memory_bytes == round_down(2 * GiB - 256 * MiB - MARGIN, UNIT)


@pytest.mark.parametrize(
    ("case", "kw", "base"),
    [
        ("vLLM's line in the failed run", {"t_kv": 30 * GiB}, 30 * GiB),
        ("vLLM's line in the live reports", {"obs_kv": 29 * GiB}, 29 * GiB),
        ("the plan", {}, utilization_kv_bytes(PLAN, 0.9, 2)),
    ],
)
def test_oom_under_utilisation_converts_to_bytes(case: str, kw: dict[str, int], base: int) -> None:
    util = ServingFlags(gpu_memory_utilization=0.9)
    s = spec_with(memory={"gpuMemoryUtilization": 0.9})
    t = term(flags=util, kv_cache_bytes=kw.get("t_kv"))
    d = decide(
        inp(spec=s, current=util, new_terminations=[t], observation=obs(GiB, kv_cache_bytes=kw.get("obs_kv")))
    )
    assert d.action == "shrink"
    assert d.flags == ServingFlags(
        kv_cache_memory_bytes=round_down(base - (2 * GiB - 512 * MiB) - MARGIN, UNIT)
    )
    assert "switching from gpu-memory-utilization to bytes" in d.message


def test_oom_under_utilisation_with_nothing_to_convert_from_degrades() -> None:
    util = ServingFlags(gpu_memory_utilization=0.9)
    d = decide(inp(current=util, plan=None, new_terminations=[term(flags=util)], observation=None))
    assert (d.action, d.reason, d.flags) == ("degrade", "NoBudgetToConvert", util)
    assert "spec.memory.gpuMemoryBytes" in d.message and d.handled


def test_oom_under_a_pinned_budget_degrades_and_names_the_knob() -> None:
    pinned = ServingFlags(kv_cache_memory_bytes=30 * GiB)
    s = spec_with(memory={"kvCacheMemoryBytes": 30 * GiB})
    d = decide(inp(spec=s, current=pinned, new_terminations=[term(flags=pinned)]))
    assert (d.action, d.reason, d.flags) == ("degrade", "PinnedBudgetOOM", pinned)
    assert "lower it by at least 2Gi" in d.message and not d.changes_flags


def test_shrink_below_the_floor_degrades_at_the_floor() -> None:
    near = ServingFlags(kv_cache_memory_bytes=FLOOR + 10 * UNIT)
    d = decide(inp(current=near, new_terminations=[term(flags=near)]))
    assert (d.action, d.reason) == ("degrade", "BudgetAtFloor")
    assert d.flags.kv_cache_memory_bytes == FLOOR and d.is_remediation
    assert "one request of maxModelLen 8192 tokens" in d.message
    assert (
        "lower spec.engine.maxModelLen or spec.engine.maxNumSeqs, raise spec.tensorParallelSize" in d.message
    )
    at = ServingFlags(kv_cache_memory_bytes=FLOOR)
    d2 = decide(inp(current=at, new_terminations=[term(flags=at)]))
    assert (d2.action, d2.flags) == ("degrade", at) and not d2.changes_flags and d2.handled


def test_the_floor_includes_min_kv_cache_bytes() -> None:
    s = spec_with(remediation={"minKVCacheBytes": 37 * GiB})
    assert kv_floor(s, PLAN) == 37 * GiB
    d = decide(inp(spec=s, new_terminations=[term()]))
    assert (d.action, d.flags.kv_cache_memory_bytes) == ("degrade", 37 * GiB)
    assert "spec.remediation.minKVCacheBytes" in d.message


def test_shrink_exactly_to_the_floor_is_a_shrink_one_block_less_degrades() -> None:
    # no deficit, 512 MiB margin = 409.6 blocks: 410 blocks above the floor lands on it exactly
    on = ServingFlags(kv_cache_memory_bytes=FLOOR + 410 * UNIT)
    d = decide(inp(current=on, new_terminations=[term(requested=GiB, free=GiB, flags=on)]))
    assert (d.action, d.flags.kv_cache_memory_bytes) == ("shrink", FLOOR)
    below = ServingFlags(kv_cache_memory_bytes=FLOOR + 409 * UNIT)
    d2 = decide(inp(current=below, new_terminations=[term(requested=GiB, free=GiB, flags=below)]))
    assert (d2.action, d2.flags.kv_cache_memory_bytes) == ("degrade", FLOOR)


def test_ooms_of_pods_running_older_flags_are_superseded() -> None:
    old = term(flags=ServingFlags(kv_cache_memory_bytes=KV + 2 * GiB))
    d = decide(inp(new_terminations=[old]))
    assert d.action == "none" and d.handled == (old.key,)
    unknown = term(flags=None)  # a pod without rankguard's annotation counts as current
    assert decide(inp(new_terminations=[unknown])).action == "shrink"


# --- guard rails ---------------------------------------------------------------------------------


def test_cooldown_holds_and_says_when_to_retry() -> None:
    t = term()
    # The last change led somewhere else (the current flags came from a person's edit).
    d = decide(inp(new_terminations=[t], history=[past(100, to=KV + GiB)]))
    assert (d.action, d.trigger, d.reason, d.held_action) == ("hold", "Cooldown", "CooldownActive", "shrink")
    assert d.retry_after == pytest.approx(200) and d.handled == () and d.flags == CUR
    assert "within the 300s cooldown" in d.message and "held: rank 2 ran out" in d.message
    assert decide(inp(new_terminations=[t], history=[past(300, to=KV + GiB)])).action == "shrink"  # boundary


def test_a_crash_under_the_last_changes_flags_is_fixed_within_the_cooldown() -> None:
    # The last change produced the current flags and they crash: waiting out the cooldown
    # would only keep the service down.
    d = decide(inp(new_terminations=[term()], history=[past(100, to=KV)]))
    assert d.action == "shrink" and d.trigger == "CUDAOutOfMemory"
    # A pre-emptive change is still held.
    four = [past(3599), past(3000), past(2000), past(100, to=KV)]
    assert decide(inp(new_terminations=[term()], history=four)).reason == "RateLimited"


def test_rate_limit_counts_the_last_hour() -> None:
    four = [past(3599), past(3000), past(2000), past(1000)]
    d = decide(inp(new_terminations=[term()], history=four))
    assert (d.action, d.trigger, d.reason) == ("hold", "RateLimit", "RateLimited")
    assert d.retry_after == pytest.approx(1)
    three = [past(3600), past(3000), past(2000), past(1000)]  # the oldest is out of the window
    assert decide(inp(new_terminations=[term()], history=three)).action == "shrink"
    none_allowed = spec_with(remediation={"maxPerHour": 0})
    assert decide(inp(spec=none_allowed, new_terminations=[term()])).trigger == "RateLimit"


def test_disabled_remediation_only_reports() -> None:
    s = spec_with(remediation={"enabled": False})
    d = decide(inp(spec=s, new_terminations=[term()]))
    assert (d.action, d.reason, d.retry_after, d.flags) == ("hold", "RemediationDisabled", None, CUR)
    assert "spec.remediation.enabled: false" in d.message
    assert decide(inp(spec=s, current=None)).action == "initial"  # still deploys


# --- rule 2: KV cache too small -----------------------------------------------------------------


def test_kv_cache_too_small() -> None:
    t = term("KVCacheTooSmall", requested=None, free=None)
    d = decide(inp(new_terminations=[t]))
    assert (d.action, d.reason, d.flags, d.handled) == ("degrade", "KVCacheTooSmall", CUR, (t.key,))
    assert "set spec.engine.kvCacheDtype: fp8" in d.message
    util = ServingFlags(gpu_memory_utilization=0.5)
    d2 = decide(inp(current=util, new_terminations=[term("KVCacheTooSmall", flags=util)]))
    assert (d2.action, d2.trigger, d2.flags) == ("replan", "KVCacheTooSmall", CUR)
    pinned = ServingFlags(kv_cache_memory_bytes=FLOOR)
    s = spec_with(memory={"kvCacheMemoryBytes": FLOOR})
    d3 = decide(inp(spec=s, current=pinned, new_terminations=[term("KVCacheTooSmall", flags=pinned)]))
    assert d3.action == "degrade" and "raise spec.memory.kvCacheMemoryBytes" in d3.message


# --- rule 3: OOMKilled ---------------------------------------------------------------------------


def test_oom_killed_raises_the_limit_like_the_vpa() -> None:
    t = term("OOMKilled", rank=None, requested=None, free=None, exit_code=137)
    d = decide(inp(new_terminations=[t]))
    assert (d.action, d.trigger, d.reason) == ("raise-memory-limit", "OOMKilled", "BumpMemoryLimit")
    expected = math.ceil(math.ceil(64 * GiB * 1.2) / MiB) * MiB  # ×1.2 beats +100 MiB at 64 GiB
    assert (
        d.flags == ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=expected)
        and expected == 78644 * MiB
    )
    assert "from 64Gi" not in d.message and "limit 64Gi; raising it to 76.8Gi" in d.message


def test_oom_killed_small_limit_gets_100_mib() -> None:
    s = spec_with(resources={"limits": {"memory": "256Mi"}})
    d = decide(inp(spec=s, new_terminations=[term("OOMKilled", flags=None)]))
    assert d.flags.memory_limit_bytes == 356 * MiB


def test_oom_killed_bump_from_a_previous_bump_and_the_ratio() -> None:
    cur = replace(CUR, memory_limit_bytes=100 * GiB)
    s = spec_with(remediation={"hostMemoryBumpRatio": 1.5})
    d = decide(inp(spec=s, current=cur, new_terminations=[term("OOMKilled", flags=cur)]))
    assert d.flags.memory_limit_bytes == 150 * GiB


def test_oom_killed_caps() -> None:
    s = spec_with(remediation={"maxHostMemory": "70Gi"})
    d = decide(inp(spec=s, new_terminations=[term("OOMKilled", flags=None)]))
    assert (
        d.flags.memory_limit_bytes == 70 * GiB
        and "capped at 70Gi (spec.remediation.maxHostMemory)" in d.message
    )
    at_cap = replace(CUR, memory_limit_bytes=70 * GiB)
    d2 = decide(inp(spec=s, current=at_cap, new_terminations=[term("OOMKilled", flags=at_cap)]))
    assert (d2.action, d2.reason, d2.flags) == ("degrade", "MemoryLimitAtCap", at_cap)
    assert "raise spec.remediation.maxHostMemory" in d2.message
    d3 = decide(inp(node_memory_bytes=72 * GiB, new_terminations=[term("OOMKilled", flags=None)]))
    assert d3.flags.memory_limit_bytes == 72 * GiB and "node's allocatable memory" in d3.message


def test_oom_killed_without_a_limit_and_superseded() -> None:
    s = parse_spec({k: v for k, v in DOC.items() if k != "resources"})
    d = decide(inp(spec=s, new_terminations=[term("OOMKilled", flags=None)]))
    assert (d.action, d.reason) == ("degrade", "NoMemoryLimit")
    assert "spec.resources.limits.memory" in d.message
    old = term("OOMKilled", flags=replace(CUR, memory_limit_bytes=32 * GiB))
    assert decide(inp(new_terminations=[old])).action == "none"


def test_oom_killed_under_a_pinned_budget_still_raises_the_limit() -> None:
    pinned = ServingFlags(kv_cache_memory_bytes=30 * GiB)
    s = spec_with(memory={"kvCacheMemoryBytes": 30 * GiB})
    d = decide(inp(spec=s, current=pinned, new_terminations=[term("OOMKilled", flags=pinned)]))
    assert d.action == "raise-memory-limit" and d.flags.kv_cache_memory_bytes == 30 * GiB


# --- rules 4-6: rollbacks ------------------------------------------------------------------------


def test_failed_rollout_rolls_back_even_in_cooldown() -> None:
    d = decide(inp(rollout=FAILED, last_known_good=LKG, history=[past(10)]))
    assert (d.action, d.trigger, d.reason, d.flags) == ("rollback", "RolloutFailed", "Rollback", LKG)
    assert "ProgressDeadlineExceeded" in d.message and "36Gi" in d.message
    five = [past(50 * i + 10) for i in range(5)]  # beyond maxPerHour too
    assert decide(inp(rollout=FAILED, last_known_good=LKG, history=five)).action == "rollback"


def test_failed_rollout_with_nothing_to_roll_back_to_degrades() -> None:
    for lkg in (None, CUR):
        d = decide(inp(rollout=FAILED, last_known_good=lkg))
        assert (d.action, d.reason, d.flags) == ("degrade", "RolloutFailed", CUR)
        assert "not a memory problem" in d.message


def test_rollback_respects_disabled() -> None:
    s = spec_with(remediation={"enabled": False})
    d = decide(inp(spec=s, rollout=FAILED, last_known_good=LKG))
    assert (d.action, d.held_action) == ("hold", "rollback")


def test_a_memory_failure_comes_before_a_failed_rollout() -> None:
    d = decide(inp(rollout=FAILED, last_known_good=LKG, new_terminations=[term()]))
    assert d.action == "shrink"


def test_engine_error_after_a_change_rolls_back() -> None:
    t = term("EngineError", rank=None, requested=None, free=None)
    d = decide(inp(last_known_good=LKG, history=[past(600, frm=KV - 2 * GiB)], new_terminations=[t]))
    assert (d.action, d.trigger, d.flags, d.handled) == ("rollback", "EngineError", LKG, (t.key,))
    # nothing changed since known good: the engine's problem, recorded and left alone
    d2 = decide(inp(last_known_good=CUR, new_terminations=[t]))
    assert (d2.action, d2.handled) == ("none", (t.key,))
    # an error from before the latest change is not the change's fault
    early = term("EngineError", finished_at=NOW - 700)
    d3 = decide(inp(last_known_good=LKG, history=[past(600)], new_terminations=[early]))
    assert (d3.action, d3.handled) == ("none", (early.key,))


def test_other_terminations_are_recorded_whatever_is_decided() -> None:
    stop = term("Other", exit_code=143)
    d = decide(inp(new_terminations=[stop, term()]))
    assert d.action == "shrink" and stop.key in d.handled
    held = decide(inp(new_terminations=[stop, term()], history=[past(10, to=KV + GiB)]))
    assert held.action == "hold" and held.handled == (stop.key,)


def grown(age: float) -> list[Remediation]:
    return [past(age, trigger="Reclaim", action="grow", frm=KV - 2 * GiB, to=KV)]


def test_headroom_worse_after_a_grow_rolls_back() -> None:
    d = decide(inp(history=grown(300), rollout=COMPLETE, observation=obs(3 * GiB, 100 * MiB)))
    assert (d.action, d.trigger, d.rank) == ("rollback", "HeadroomWorse", 1)
    assert d.flags == ServingFlags(kv_cache_memory_bytes=KV - 2 * GiB)
    assert "rank 1's headroom fell to 100Mi, below the minimum 256Mi" in d.message


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"history": grown(901), "rollout": COMPLETE, "observation": obs(100 * MiB)}, "too long ago"),
        ({"history": grown(300), "rollout": PROGRESSING, "observation": obs(100 * MiB)}, "still rolling"),
        ({"history": grown(300), "rollout": COMPLETE, "observation": obs(MINH)}, "at the minimum"),
        ({"history": grown(300), "rollout": COMPLETE, "observation": obs(100 * MiB, stale=True)}, "stale"),
        ({"history": [past(300)], "rollout": COMPLETE, "observation": obs(100 * MiB)}, "not a grow"),
    ],
)
def test_headroom_worse_boundaries(kw: dict[str, Any], why: str) -> None:
    assert decide(inp(**kw)).action == "none", why


# --- rule 7: low headroom ------------------------------------------------------------------------

LOW = obs(3 * GiB, 100 * MiB, 3 * GiB, 3 * GiB)


def test_sustained_low_headroom_shrinks_before_an_oom() -> None:
    d = decide(inp(observation=LOW, low_headroom_since=NOW - 60))
    assert (d.action, d.trigger, d.rank) == ("shrink", "LowHeadroom", 1)
    assert d.flags.kv_cache_memory_bytes == round_down(KV - (MINH - 100 * MiB) - MARGIN, UNIT)
    assert "below the minimum headroom 256Mi, for 60s" in d.message


def test_low_headroom_not_yet_sustained_or_not_fresh() -> None:
    d = decide(inp(observation=LOW, low_headroom_since=NOW - 59.9))
    assert (d.action, d.reason) == ("none", "LowHeadroom") and "shrinks after 60s" in d.message
    stale = decide(inp(observation=obs(100 * MiB, stale=True), low_headroom_since=NOW - 600))
    assert (stale.action, stale.reason) == ("none", "NoFreshData")


def test_low_headroom_under_a_pinned_budget_holds() -> None:
    pinned = ServingFlags(kv_cache_memory_bytes=30 * GiB)
    s = spec_with(memory={"kvCacheMemoryBytes": 30 * GiB})
    d = decide(inp(spec=s, current=pinned, observation=LOW, low_headroom_since=NOW - 600))
    assert (d.action, d.reason, d.held_action) == ("hold", "PinnedBudget", "shrink")
    assert "lower it by at least 668Mi" in d.message


# --- rule 8: replan when measurements arrive ------------------------------------------------------

MEASURED = _must(
    initial_plan(
        SPEC,
        measured=[RankMeasurement(r, total_bytes=80 * GiB, free_after_init_bytes=75 * GiB) for r in range(4)],
    )
)


def test_utilisation_for_lack_of_a_plan_becomes_bytes() -> None:
    util = ServingFlags(gpu_memory_utilization=0.9)
    d = decide(inp(current=util))
    assert (d.action, d.trigger, d.flags) == ("replan", "Planned", CUR)
    d2 = decide(inp(current=util, plan=MEASURED))
    assert (d2.trigger, d2.flags.kv_cache_memory_bytes) == ("Measured", MEASURED.kv_cache_memory_bytes)
    # a utilisation the user asked for stays until the first OOM
    s = spec_with(memory={"gpuMemoryUtilization": 0.9})
    assert decide(inp(spec=s, current=util)).action == "none"


def test_probe_figures_only_tighten_the_prior_budget_once() -> None:
    # A probe that finds every rank lighter than the prior does not raise the budget: it cannot
    # see NCCL's lazily allocated buffers. Growing is reclaim's job, under real load.
    assert MEASURED.kv_cache_memory_bytes == KV + 1178 * UNIT
    assert decide(inp(plan=MEASURED)).action == "none"
    above = ServingFlags(kv_cache_memory_bytes=MEASURED.kv_cache_memory_bytes + 2000 * UNIT)
    d = decide(inp(plan=MEASURED, current=above))
    assert (d.action, d.trigger) == ("replan", "Measured")
    assert d.flags.kv_cache_memory_bytes == MEASURED.kv_cache_memory_bytes
    assert "the measured plan replaces the prior one" in d.message
    assert (
        decide(inp(plan=MEASURED, current=above, history=[past(7200)])).action == "none"
    )  # not after a change
    close = ServingFlags(kv_cache_memory_bytes=MEASURED.kv_cache_memory_bytes + 100 * UNIT)
    assert decide(inp(plan=MEASURED, current=close)).action == "none"  # 125 MiB: not worth a roll


# --- rule 9: reclaim -----------------------------------------------------------------------------

AMPLE = obs(6 * GiB, 5 * GiB, 6 * GiB, 6 * GiB)
SMALLER = ServingFlags(kv_cache_memory_bytes=round_down(KV - 8 * GiB, UNIT))


def reclaim(**kw: Any) -> Decision:
    args: dict[str, Any] = {"current": SMALLER, "observation": AMPLE, "ample_headroom_since": NOW - 1800}
    args.update(kw)
    return decide(inp(**args))


def test_reclaim_grows_by_half_the_excess_over_the_margin() -> None:
    d = reclaim()
    assert (d.action, d.trigger, d.reason, d.rank) == ("grow", "Reclaim", "GrowKVCache", 1)
    step = round_down((5 * GiB - MARGIN) // 2, UNIT)
    assert d.flags.kv_cache_memory_bytes == round_down(KV - 8 * GiB, UNIT) + step
    assert "every rank has kept at least 512Mi free for 30 min" in d.message


def test_reclaim_never_exceeds_the_ceiling() -> None:
    ceiling = kv_ceiling(SPEC, PLAN)
    assert ceiling is not None and ceiling == round_down(min(r.safe_kv_bytes for r in PLAN.ranks), UNIT)
    d = reclaim(current=CUR)
    assert (d.action, d.flags.kv_cache_memory_bytes) == ("grow", ceiling)
    assert "capped at" in d.message
    s = spec_with(remediation={"maxKVCacheBytes": KV - 7 * GiB})
    assert reclaim(spec=s).flags.kv_cache_memory_bytes == round_down(KV - 7 * GiB, UNIT)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"ample_headroom_since": NOW - 1799}, "not long enough"),
        ({"ample_headroom_since": None}, "never ample"),
        ({"spec": spec_with(memory={"reclaim": False})}, "reclaim off"),
        ({"observation": obs(6 * GiB, 511 * MiB)}, "a rank below 2 × minHeadroom"),
        ({"observation": obs(6 * GiB, stale=True)}, "stale"),
        ({"plan": None}, "no ceiling at all"),
        ({"history": [past(1799, frm=KV, to=KV - 8 * GiB)]}, "a change within the window"),
        ({"rollout": PROGRESSING}, "rolling"),
        ({"observation": obs(900 * MiB)}, "step below 256 MiB"),
        (
            {
                "current": ServingFlags(gpu_memory_utilization=0.9),
                "spec": spec_with(memory={"gpuMemoryUtilization": 0.9}),
            },
            "util",
        ),
    ],
)
def test_reclaim_does_not_apply(kw: dict[str, Any], why: str) -> None:
    assert reclaim(**kw).action == "none", why


def test_reclaim_never_returns_past_a_budget_that_crashed_within_a_day() -> None:
    crashed = past(7200, frm=KV - 6 * GiB, to=KV - 7 * GiB)  # the shrink that fixed a CUDA OOM
    d = reclaim(history=[crashed])
    assert d.action == "grow" and d.flags.kv_cache_memory_bytes == round_down(KV - 7 * GiB, UNIT)
    pressure = past(7200, trigger="LowHeadroom", frm=KV - 6 * GiB, to=KV - 7 * GiB)
    assert reclaim(history=[pressure]).flags.kv_cache_memory_bytes == round_down(KV - 6 * GiB - UNIT, UNIT)
    old = past(86401, frm=KV - 6 * GiB, to=KV - 7 * GiB)
    assert (reclaim(history=[old]).flags.kv_cache_memory_bytes or 0) > KV - 6 * GiB


# --- steady state and the trackers ----------------------------------------------------------------


def test_steady() -> None:
    d = decide(inp())
    assert (d.action, d.reason, d.rank, d.flags, d.handled) == ("none", "Stable", 0, CUR, ())
    assert not d.changes_flags and "bottleneck rank 0 has 2Gi headroom" in d.message
    assert decide(inp(observation=None)).reason == "NoFreshData"


def test_track_low_headroom() -> None:
    assert track_low_headroom(None, LOW, SPEC, NOW) == NOW
    assert track_low_headroom(NOW - 30, LOW, SPEC, NOW) == NOW - 30
    assert track_low_headroom(NOW - 30, HEALTHY, SPEC, NOW) is None
    assert track_low_headroom(NOW - 30, obs(MINH), SPEC, NOW) is None  # at the minimum is fine
    assert track_low_headroom(NOW - 30, obs(GiB, stale=True), SPEC, NOW) == NOW - 30
    assert track_low_headroom(None, None, SPEC, NOW) is None


def test_track_ample_headroom() -> None:
    assert track_ample_headroom(None, AMPLE, SPEC, NOW) == NOW
    assert track_ample_headroom(NOW - 5, AMPLE, SPEC, NOW) == NOW - 5
    assert track_ample_headroom(NOW - 5, obs(2 * MINH), SPEC, NOW) == NOW - 5  # boundary: 2 × minimum
    assert track_ample_headroom(NOW - 5, obs(2 * MINH - 1), SPEC, NOW) is None
    assert track_ample_headroom(NOW - 5, None, SPEC, NOW) == NOW - 5


def test_last_known_good() -> None:
    def lkg(**kw: Any) -> ServingFlags | None:
        args: dict[str, Any] = {"spec": SPEC, "rollout": COMPLETE, "observation": HEALTHY}
        args.update(kw)
        return next_last_known_good(LKG, CUR, **args)

    assert lkg() == CUR
    assert lkg(rollout=PROGRESSING) == LKG
    assert lkg(rollout=None) == LKG
    assert lkg(observation=LOW) == LKG
    assert lkg(observation=obs(GiB, stale=True)) == LKG
    assert lkg(terminations=[term()]) == LKG
    assert lkg(terminations=[term(flags=LKG)]) == CUR  # an old pod's crash says nothing about CUR
    assert lkg(terminations=[term("Other")]) == CUR
    assert next_last_known_good(LKG, None, spec=SPEC, rollout=COMPLETE, observation=HEALTHY) == LKG


# --- properties ----------------------------------------------------------------------------------


@given(
    blocks=st.integers(FLOOR // UNIT, (70 * GiB) // UNIT),
    deficit=st.integers(0, 40 * GiB),
    margin=st.integers(0, 4 * GiB),
)
def test_shrink_never_grows_and_never_crosses_the_floor_silently(
    blocks: int, deficit: int, margin: int
) -> None:
    spec = spec_with(memory={"safetyMarginBytes": margin, "minHeadroomBytes": min(MINH, margin)})
    before = blocks * UNIT
    cur = ServingFlags(kv_cache_memory_bytes=before)
    t = term(requested=deficit + GiB, free=GiB, flags=cur)
    d = decide(inp(spec=spec, current=cur, new_terminations=[t]))
    new = d.flags.kv_cache_memory_bytes
    assert new is not None and new % UNIT == 0 and new <= before
    wanted = round_down(before - deficit - margin, UNIT)
    if d.action == "shrink":
        assert FLOOR <= new <= before - UNIT and new <= before - deficit - margin
    else:
        # at the floor already: said as such, and nothing to roll
        reason = "OOMAtFloor" if before == FLOOR else "BudgetAtFloor"
        assert (d.action, d.reason, new) == ("degrade", reason, FLOOR)
        assert min(wanted, before - UNIT) < FLOOR  # degrade only when the shrink would cross the floor


@given(min_free=st.integers(0, 20 * GiB), kv_blocks=st.integers(1000, 40_000))
def test_grow_stays_within_ceiling_and_keeps_the_margin(min_free: int, kv_blocks: int) -> None:
    cur = ServingFlags(kv_cache_memory_bytes=kv_blocks * UNIT)
    d = reclaim(current=cur, observation=obs(min_free, 20 * GiB))
    if d.action == "grow":
        new = d.flags.kv_cache_memory_bytes
        assert new is not None
        ceiling = kv_ceiling(SPEC, PLAN)
        assert ceiling is not None and new <= ceiling
        grown_by = new - kv_blocks * UNIT
        assert grown_by >= 256 * MiB and min_free - grown_by >= MARGIN  # the margin stays free
    else:
        assert d.action in ("none", "replan", "degrade")


# --- budget bounds -------------------------------------------------------------------------------


def test_budget_key_changes_only_with_budget_inputs() -> None:
    k = budget_key(SPEC)
    assert budget_key(parse_spec(copy.deepcopy(DOC))) == k
    for changed in (
        spec_with(engine={"maxNumSeqs": 128}),
        spec_with(memory={"safetyMarginBytes": GiB}),
        spec_with(remediation={"maxKVCacheBytes": 30 * GiB}),
        parse_spec({**DOC, "tensorParallelSize": 8}),
    ):
        assert budget_key(changed) != k
    for same in (parse_spec({**DOC, "replicas": 3}), parse_spec({**DOC, "image": "vllm:other"})):
        assert budget_key(same) == k


def test_initial_plan_inputs() -> None:
    no_gpu = parse_spec({k: v for k, v in DOC.items() if k != "memory"})
    assert initial_plan(no_gpu) is None
    m = [RankMeasurement(0, total_bytes=79 * GiB), RankMeasurement(9, total_bytes=1)]  # rank 9: another TP
    plan = initial_plan(no_gpu, measured=m)
    assert plan is not None and plan.inputs.gpu_memory_bytes == 79 * GiB
    assert [x.rank for x in plan.inputs.measured] == [0]
    cm = parse_spec({**DOC, "model": {"name": "acme/x", "configMap": {"name": "c"}}})
    assert initial_plan(cm) is None  # its ConfigMap not read yet: nothing describes the model
    assert kv_ceiling(no_gpu, None) is None and block_unit(None) == MiB and kv_floor(no_gpu, None) == 1
