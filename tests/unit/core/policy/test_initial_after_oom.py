"""A spec edit to a budget input after a remediation never restarts at a budget that ran out of
GPU memory within the day (issue 50, point 9). Before, the re-render after the edit went back to
the spec's utilisation (or the plan's budget) that had just OOMed, crash-looped through the same
OOM, and the fix then waited out the cooldown (~3 minutes at a known-bad budget): the crash was
under flags the last change had not made. Now the re-render starts at the byte budget that
answered the OOM, as history keeps it, unless the edit itself starts lower."""

from __future__ import annotations

from dataclasses import replace

from rankguard_operator.core.budget.bounds import budget_key, utilization_kv_bytes
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy import decide
from rankguard_operator.core.policy.decision import Decision
from rankguard_operator.core.policy.history import Remediation
from rankguard_operator.core.policy.tunables import BAD_BUDGET_MEMORY_SECONDS, LEVER_KV
from rankguard_operator.core.units import GiB, format_bytes
from tests.unit.core.policy_world import KV, NOW, PLAN, inp, spec_with

UTIL = spec_with(memory={"gpuMemoryUtilization": 0.9})
ANSWER = ServingFlags(kv_cache_memory_bytes=30 * GiB)  # what rankguard cut to after the OOM at 0.9


def oom_answer(
    frm: ServingFlags, to: ServingFlags, age: float = 600.0, lever: str | None = None
) -> Remediation:
    return Remediation(NOW - age, "CUDAOutOfMemory", "shrink", 2, frm, to, lever=lever)


AT_UTIL = oom_answer(ServingFlags(gpu_memory_utilization=0.9), ANSWER)


def edited(memory: dict[str, object], history: list[Remediation], **kw: object) -> Decision:
    """The re-render after a person edits spec.engine.maxNumSeqs (a budget input) under `memory`."""
    before = spec_with(memory=memory)
    after = spec_with(memory=memory, engine={"maxModelLen": 8192, "maxNumSeqs": 128})
    assert budget_key(before) != budget_key(after)
    args = {"spec": after, "current": ANSWER, "budget_key": budget_key(before), "history": history, **kw}
    return decide(inp(**args))


def test_the_edit_does_not_restart_at_the_utilisation_that_just_ran_out() -> None:
    d = edited({"gpuMemoryUtilization": 0.9}, [AT_UTIL])
    assert (d.action, d.trigger, d.reason) == ("initial", "SpecChanged", "FailedBudgetAvoided")
    assert d.flags == ANSWER  # not gpu-memory-utilization 0.9 again: nothing rolls onto a known OOM
    assert not d.changes_flags
    assert "gpu-memory-utilization 0.9 ran out of GPU memory 10 min ago (rank 2)" in d.message
    assert f"starting at the per-GPU KV budget {format_bytes(30 * GiB)} instead" in d.message


def test_a_utilisation_the_person_lowered_below_the_failed_one_is_theirs() -> None:
    d = edited({"gpuMemoryUtilization": 0.8}, [AT_UTIL])
    assert (d.reason, d.flags) == ("UtilizationStart", ServingFlags(gpu_memory_utilization=0.8))


def test_a_failure_older_than_a_day_is_forgotten() -> None:
    old = replace(AT_UTIL, time=NOW - BAD_BUDGET_MEMORY_SECONDS - 1)
    d = edited({"gpuMemoryUtilization": 0.9}, [old])
    assert (d.reason, d.flags) == ("UtilizationStart", ServingFlags(gpu_memory_utilization=0.9))


def test_the_plans_budget_is_capped_at_the_answer_to_a_byte_budget_that_failed() -> None:
    answered = ServingFlags(kv_cache_memory_bytes=KV - 2 * GiB)
    d = edited({}, [oom_answer(ServingFlags(kv_cache_memory_bytes=KV), answered, lever=LEVER_KV)])
    assert d.reason == "FailedBudgetAvoided" and d.flags == answered
    assert f"the KV budget {format_bytes(KV)} ran out of GPU memory" in d.message
    # a utilisation that failed caps a plan's budget that would give as much
    util = oom_answer(ServingFlags(gpu_memory_utilization=0.5), answered)
    assert utilization_kv_bytes(PLAN, 0.5) <= KV
    assert edited({}, [util]).flags == answered


def test_another_levers_move_or_a_pinned_budget_is_left_alone() -> None:
    at_kv = ServingFlags(kv_cache_memory_bytes=KV)
    seqs = oom_answer(at_kv, replace(at_kv, max_num_seqs=128), lever="max-num-seqs")
    assert edited({}, [seqs]).flags == ServingFlags(kv_cache_memory_bytes=PLAN.kv_cache_memory_bytes)
    pinned = edited(
        {"kvCacheMemoryBytes": 35 * GiB}, [oom_answer(ServingFlags(kv_cache_memory_bytes=35 * GiB), ANSWER)]
    )
    assert (pinned.reason, pinned.flags) == ("BudgetPinned", ServingFlags(kv_cache_memory_bytes=35 * GiB))
