"""Rules 6-9: live headroom (a grow made it worse, sustained low headroom), a measured re-plan,
and reclaiming idle headroom.

The agents' figures move the budget before an OOM does: down when a rank runs low, back when
a grow made things worse, and up, once, to the least free memory the bottleneck kept over a
30-minute stretch (less the low-headroom line and a jitter allowance), never past
spec.remediation.maxKVCacheBytes or a budget that crashed within a day.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.budget.bounds import after_kv_bytes, initial_plan, kv_ceiling, round_down
from rankguard_operator.core.budget.planner import RankMeasurement
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy import Decision, decide
from rankguard_operator.core.policy.history import Remediation
from rankguard_operator.core.policy.tunables import HEADROOM_JITTER_BYTES
from rankguard_operator.core.units import GiB, MiB
from tests.unit.core.policy_world import (
    AMPLE,
    COMPLETE,
    CUR,
    KV,
    LOW,
    MINH,
    NOW,
    PLAN,
    PROGRESSING,
    SPEC,
    UNIT,
    inp,
    must,
    obs,
    past,
    spec_with,
)

# --- rule 6: headroom worse after a grow ---------------------------------------------------------


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


def test_sustained_low_headroom_shrinks_before_an_oom() -> None:
    d = decide(inp(observation=LOW, low_headroom_since=NOW - 60))
    assert (d.action, d.trigger, d.rank) == ("shrink", "LowHeadroom", 1)
    # measured: down by the deficit and the jitter allowance, where a fill would land
    assert d.flags.kv_cache_memory_bytes == round_down(KV - (MINH - 100 * MiB) - HEADROOM_JITTER_BYTES, UNIT)
    assert "below the minimum headroom 256Mi, for 60s" in d.message and "jitter allowance" in d.message
    # over a utilisation the budget cut is an estimate: the safety margin covers it
    util = decide(
        inp(current=ServingFlags(gpu_memory_utilization=0.9), observation=LOW, low_headroom_since=NOW - 60)
    )
    assert util.action == "shrink" and "safety margin" in util.message


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
    assert "lower it by at least 220Mi" in d.message  # the 156 MiB deficit and the jitter allowance


# --- rule 8: replan when measurements arrive ------------------------------------------------------

MEASURED = must(
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

SMALLER = ServingFlags(kv_cache_memory_bytes=round_down(KV - 8 * GiB, UNIT))


def reclaim(**kw: Any) -> Decision:
    args: dict[str, Any] = {"current": SMALLER, "observation": AMPLE, "ample_headroom_since": NOW - 1800}
    args.update(kw)
    return decide(inp(**args))


KEEP = MINH + HEADROOM_JITTER_BYTES  # what a fill leaves free on the bottleneck


def test_reclaim_fills_up_to_the_stretchs_lowest_free_memory_less_the_line_and_jitter() -> None:
    d = reclaim(ample_headroom_lowest=4 * GiB)
    assert (d.action, d.trigger, d.reason, d.rank) == ("grow", "Reclaim", "GrowKVCache", 1)
    assert d.flags.kv_cache_memory_bytes == SMALLER.kv_cache_memory_bytes + round_down(4 * GiB - KEEP, UNIT)
    assert "every rank has kept at least 512Mi free for 30 min" in d.message
    assert "at least 4Gi" in d.message and "filling the bottleneck's lowest free memory" in d.message
    # the window's own minimum counts too when it is lower than the stretch's
    d2 = reclaim(ample_headroom_lowest=6 * GiB)
    assert d2.flags.kv_cache_memory_bytes == SMALLER.kv_cache_memory_bytes + round_down(5 * GiB - KEEP, UNIT)


def test_a_measured_stretch_lifts_the_plans_prior_ceiling_but_not_the_spec_maximum() -> None:
    ceiling = kv_ceiling(SPEC, PLAN)
    assert ceiling is not None
    d = reclaim(current=CUR, ample_headroom_lowest=5 * GiB)
    new = d.flags.kv_cache_memory_bytes
    assert d.action == "grow" and new == KV + round_down(5 * GiB - KEEP, UNIT) and new > ceiling
    s = spec_with(remediation={"maxKVCacheBytes": KV + GiB})
    capped = reclaim(spec=s, current=CUR, ample_headroom_lowest=5 * GiB).flags.kv_cache_memory_bytes
    assert capped == round_down(KV + GiB, UNIT)


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
        ({"observation": obs(560 * MiB)}, "step below 256 MiB"),
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


def test_reclaim_may_take_back_the_room_a_kv_allocation_cut_left_but_not_the_budget_that_failed() -> None:
    # A KV-allocation OOM's cut left the plan's room for what comes after the KV cache (issue 50):
    # that room is a prior, not a budget that failed, so growing may take it back as far as live
    # headroom shows it unused; the budget that failed stays out of reach for the day
    room = after_kv_bytes(PLAN, 1, enforce_eager=False)
    small = SMALLER.kv_cache_memory_bytes
    assert small is not None
    cut = replace(past(7200, frm=KV - 2 * GiB, to=small), phase="kv-allocation", lever="kv-budget", rank=1)
    d = reclaim(history=[cut])
    assert d.action == "grow" and d.flags.kv_cache_memory_bytes == small + round_down(room, UNIT)
    # an OOM of another phase (or unknown) keeps the cap at its own answer, as before
    other = replace(cut, phase=None, lever=None)
    assert reclaim(history=[other]).action == "none"
    # never past the budget that failed, less one block
    near = replace(cut, from_flags=ServingFlags(kv_cache_memory_bytes=small + 10 * UNIT))
    assert reclaim(history=[near]).action == "none"  # 10 blocks: not worth a roll


# --- properties ----------------------------------------------------------------------------------


@given(min_free=st.integers(0, 20 * GiB), kv_blocks=st.integers(1000, 40_000))
def test_grow_stays_within_ceiling_and_keeps_the_margin(min_free: int, kv_blocks: int) -> None:
    cur = ServingFlags(kv_cache_memory_bytes=kv_blocks * UNIT)
    d = reclaim(current=cur, observation=obs(min_free, 20 * GiB))
    if d.action == "grow":
        new = d.flags.kv_cache_memory_bytes
        assert new is not None
        ceiling = kv_ceiling(SPEC, PLAN)
        assert ceiling is not None and new <= ceiling  # no stretch lowest tracked: the prior caps
        grown_by = new - kv_blocks * UNIT
        assert grown_by >= 256 * MiB and min_free - grown_by >= KEEP  # the line and jitter stay free
    else:
        assert d.action in ("none", "replan", "degrade")
