"""Rules 1-5: a run ended badly (CUDA OOM, KV cache too small, OOMKilled, a failed rollout,
an engine error after a change).

Each crash is answered by the change that fixes it: a shrink by the deficit plus the safety
margin in whole blocks and never below the floor, a raised memory limit, or a roll back to
last-known-good; what no flag can fix is Degraded, naming the knob.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.budget.bounds import kv_floor, round_down, utilization_kv_bytes
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.policy import decide
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB, MiB
from tests.unit.core.policy_world import (
    CUR,
    DOC,
    FAILED,
    FLOOR,
    KV,
    LKG,
    MARGIN,
    MINH,
    NOW,
    PLAN,
    UNIT,
    inp,
    obs,
    past,
    spec_with,
    term,
)

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
        "the per-GPU KV budget from 37Gi to 35Gi (deficit 1.5Gi plus the 512Mi safety margin)"
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


# --- rule 1, start-up refusals: the budget is not what failed ---------------------------------


def refusal(*, weights: int | None, flags: ServingFlags | None = CUR, free: int | None = None) -> Termination:
    """vLLM's start-up refusal on rank 1 of an 80 GiB card at utilisation 0.9 (72 GiB): free
    memory below it, or (`weights`) weights held outside the process at or above it."""
    t = term(rank=1, requested=72 * GiB, free=free, flags=flags)
    return replace(t, startup_refusal=True, external_weight_bytes=weights)


def test_external_weights_refusal_under_a_byte_budget_keeps_the_budget() -> None:
    """The weights another process holds on the GPU reached total x utilisation: vLLM allocated
    nothing, so no shrink; the budget stays and the rendered utilisation rises above them."""
    t = refusal(weights=75 * GiB)
    d = decide(inp(new_terminations=[t]))
    assert (d.action, d.trigger, d.reason, d.rank) == ("none", "CUDAOutOfMemory", "ExternalWeightsRefused", 1)
    assert d.flags == CUR and not d.changes_flags and d.handled == (t.key,)
    assert (
        "the weights another process holds on the GPU (75Gi) exceed its GPU memory utilisation" in d.message
    )
    assert "now stays above those 75Gi" in d.message
    # the other refusal (free memory) keeps its own answer
    free = refusal(weights=None, free=60 * GiB)
    assert decide(inp(new_terminations=[free])).reason == "StartupCheckRefused"


def test_external_weights_refusal_under_a_utilisation_switches_to_the_planned_budget() -> None:
    util = ServingFlags(gpu_memory_utilization=0.9)
    d = decide(inp(current=util, new_terminations=[refusal(weights=75 * GiB, flags=util)]))
    assert (d.action, d.trigger, d.flags) == (
        "replan",
        "CUDAOutOfMemory",
        CUR,
    )  # the plan's budget, no shrink
    assert "stays above the weights held outside" in d.message
    # the free-memory refusal under a utilisation is still an OOM to shrink for
    shrink = decide(inp(current=util, new_terminations=[refusal(weights=None, flags=util, free=60 * GiB)]))
    assert shrink.action == "shrink"
    # with no plan to switch to: Degraded, naming the utilisation that would do ((75 + 0.5) / 80, up)
    d2 = decide(inp(current=util, plan=None, new_terminations=[refusal(weights=75 * GiB, flags=util)]))
    assert (d2.action, d2.reason, d2.flags) == ("degrade", "ExternalWeightsRefused", util)
    assert "raise spec.memory.gpuMemoryUtilization to at least 0.95" in d2.message


def test_external_weights_that_fill_the_gpu_degrade() -> None:
    t = refusal(weights=80 * GiB - MARGIN)
    d = decide(inp(new_terminations=[t]))
    assert (d.action, d.reason, d.flags) == ("degrade", "ExternalWeightsFillGPU", CUR)
    assert "spec.tensorParallelSize" in d.message


def test_an_external_weights_refusal_with_a_runtime_oom_still_shrinks() -> None:
    """A real OOM in the same pass is a real OOM: the shrink it asks for wins."""
    d = decide(inp(new_terminations=[refusal(weights=75 * GiB), term(rank=2)]))
    assert d.action == "shrink" and d.rank == 2


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


def test_oom_killed_says_the_phase_and_keeps_it_but_moves_only_the_memory_limit() -> None:
    t = replace(term("OOMKilled", rank=None, requested=None, free=None, exit_code=137), phase="weights")
    d = decide(inp(new_terminations=[t]))
    assert d.action == "raise-memory-limit" and d.phase == "weights"
    assert "was OOMKilled while loading the weights at the container memory limit 64Gi" in d.message
    unknown = decide(inp(new_terminations=[term("OOMKilled", rank=None, requested=None, free=None)]))
    assert unknown.phase is None and "was OOMKilled at the container memory limit" in unknown.message
    assert d.flags == unknown.flags


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


# --- rules 4-5: rollbacks ------------------------------------------------------------------------


def test_failed_rollout_rolls_back_even_in_cooldown() -> None:
    d = decide(inp(rollout=FAILED, last_known_good=LKG, history=[past(10)]))
    assert (d.action, d.trigger, d.reason, d.flags) == ("rollback", "RolloutFailed", "Rollback", LKG)
    assert "ProgressDeadlineExceeded" in d.message and "35Gi" in d.message
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
