"""Rule 0: the first flags of a service, and the flags after its budget inputs changed.

A new service starts from the pinned budget, the user's utilisation or the plan (priors or
probe figures), within the ceiling and never below the floor; a changed spec re-plans the same
way and settles the terminations of the old one.
"""

from __future__ import annotations

from dataclasses import replace

from rankguard_operator.core.budget.bounds import budget_key, initial_plan, round_down
from rankguard_operator.core.budget.planner import RankMeasurement
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy import decide
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from tests.unit.core.policy_world import CUR, KV, SPEC, UNIT, inp, spec_with, term


def test_initial_from_the_prior_plan() -> None:
    d = decide(inp(current=None, observation=None))
    assert (d.action, d.trigger, d.reason, d.rank) == ("initial", "Initial", "BudgetPlanned", 0)
    assert d.flags == ServingFlags(kv_cache_memory_bytes=KV)
    assert d.changes_flags and not d.is_remediation
    assert "37Gi from priors" in d.message and "rank 0 is the bottleneck" in d.message


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


def test_a_plan_below_one_request_that_the_ranks_can_still_hold_starts_at_one_request() -> None:
    # Qwen2.5-72B at TP2 on 80 GB cards: the priors (NCCL after traffic, the margin) leave less
    # than one 8K request, but weights, logits and the least non-torch memory leave room: vLLM
    # serves it, so rankguard starts at one request instead of calling the service Degraded.
    doc = {
        "model": {"name": "Qwen/Qwen2.5-72B"},
        "image": "vllm/vllm-openai:v0.33.0",
        "tensorParallelSize": 2,
        "engine": {"maxModelLen": 8192},
        "memory": {"gpuMemoryBytes": round(79.2 * GiB)},
    }
    s = parse_spec(doc)
    plan = initial_plan(s)
    assert plan is not None and plan.feasible and plan.kv_cache_memory_bytes < plan.min_kv_cache_memory_bytes
    d = decide(inp(spec=s, plan=plan, current=None, observation=None))
    assert (d.action, d.reason) == ("initial", "BudgetAtOneRequest")
    assert d.flags.kv_cache_memory_bytes == plan.min_kv_cache_memory_bytes
    assert "starting at one request" in d.message
    # a floor the spec asks for is not the planner's to waive: still Degraded below it
    floor = spec_with(remediation={"minKVCacheBytes": 50 * GiB})
    assert decide(inp(spec=floor, current=None)).reason == "BudgetBelowFloor"


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
