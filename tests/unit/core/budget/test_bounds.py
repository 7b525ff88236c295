"""The budget bounds the policy relies on: the setting's block, floor and budget, the key
whose change re-plans a service, and the inputs the initial plan is made from.
"""

from __future__ import annotations

import copy

from rankguard_operator.core.budget.bounds import block_unit, budget_key, initial_plan, kv_ceiling, kv_floor
from rankguard_operator.core.budget.planner import RankMeasurement
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB, MiB
from tests.unit.core.policy_world import DOC, FLOOR, KV, SPEC, UNIT, spec_with


def test_the_setting() -> None:
    # the floor is one 8192-token request (512 blocks) plus vLLM 0.33's null block
    assert (39_735_787_520, 1_310_720, 640 * MiB + 1_310_720) == (KV, UNIT, FLOOR)
    assert KV % UNIT == 0


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
    same_release_facts = (
        "vllm/vllm-openai:v0.33.1",
        "vllm/vllm-openai:v0.32.0",
        "registry.local/vllm:v0.30.0",
    )
    for same in (
        parse_spec({**DOC, "replicas": 3}),
        *(parse_spec({**DOC, "image": i}) for i in same_release_facts),
    ):
        assert budget_key(same) == k


def test_budget_key_changes_with_the_release_block_size() -> None:
    # vLLM 0.34 counts 64-token blocks: a budget planned for 0.33's 16 is planned again (a tag
    # naming no release is judged as the newest recorded one, 0.34)
    k = budget_key(SPEC)
    for image in ("vllm/vllm-openai:v0.34.0", "vllm/vllm-openai:v0.35.2", "vllm:other"):
        assert budget_key(parse_spec({**DOC, "image": image})) != k
    assert budget_key(parse_spec({**DOC, "image": "vllm/vllm-openai:v0.34.0"})) == budget_key(
        parse_spec({**DOC, "image": "vllm/vllm-openai:v0.35.2"})
    )


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
