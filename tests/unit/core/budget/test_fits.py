"""A floor above what fits beside the weights is refused before anything is deployed (issue 50,
point 9): before, a spec.remediation.minKVCacheBytes below the GPU's size but above what the
weights leave was deployed at the floor, ran out of memory allocating the KV cache on every
start and crash-looped until OOMAtFloor."""

from __future__ import annotations

import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.budget.fits import BudgetDoesNotFit, check_budget_fits
from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.model.resolve import resolve
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from tests.unit.reconcile_world import SPEC, Cluster

GPU = (80 * GiB, "spec.memory.gpuMemoryBytes")


def spec_with_floor(floor: int) -> dict[str, object]:
    return {**SPEC, "remediation": {"minKVCacheBytes": floor}}


def room() -> int:
    """What the least each rank of SPEC (Llama-3-8B, TP2, 80 GiB) needs beside its KV leaves."""
    plan = prior_plan(parse_spec(SPEC))
    assert plan is not None
    return min(r.total_bytes - r.least_non_kv_bytes for r in plan.ranks)


def test_a_floor_above_what_the_weights_leave_is_refused_naming_the_rank_and_the_room() -> None:
    most = room()
    assert 70 * GiB < most < 75 * GiB  # 8 GiB of weights, context and logits beside it
    spec = parse_spec(spec_with_floor(75 * GiB))  # below the GPU: the parser and the old check pass
    with pytest.raises(BudgetDoesNotFit) as refused:
        check_budget_fits(spec, resolve(spec), GPU)
    message = str(refused.value)
    assert "spec.remediation.minKVCacheBytes (75Gi" in message and "beside what rank 0 needs" in message
    assert "every start would run out of memory allocating the KV cache" in message
    # one block under the room is still a floor a start can have: it is deployed (at the floor)
    below = parse_spec(spec_with_floor(most))
    check_budget_fits(below, resolve(below), GPU)


def test_under_a_pinned_budget_the_floor_decides_nothing_and_is_not_judged() -> None:
    doc = {
        **spec_with_floor(75 * GiB),
        "memory": {"gpuMemoryBytes": 80 * GiB, "kvCacheMemoryBytes": 76 * GiB},
    }
    pinned = parse_spec(doc)
    check_budget_fits(pinned, resolve(pinned), GPU)  # the pinned budget is what runs, never the floor


def test_the_step_refuses_it_before_deploying_anything() -> None:
    c = Cluster()
    c.spec["remediation"] = {"minKVCacheBytes": 75 * GiB}
    steps = [c.run() for _ in range(2)]
    assert c.deployment is None and c.service is None
    assert c.status["phase"] == "Failed"
    degraded = next(x for x in c.status["conditions"] if x["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "beside what rank 0 needs" in degraded["message"]
    said = [e for s in steps for e in s.effects if isinstance(e, PostEvent) and e.reason == "InvalidSpec"]
    assert len(said) == 1
