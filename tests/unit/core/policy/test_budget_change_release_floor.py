"""The shrink lever stops at the floor of the engine's release: one request at maxModelLen in the
blocks that release uses (vLLM 0.34: 64 tokens, 0.33: 16) plus the null block. A CUDA OOM just
above 0.34's floor degrades at 0.34's floor there, and at 0.33's lower one on 0.33 (issue 51)."""

from __future__ import annotations

import pytest

from rankguard_operator.core.budget.bounds import block_unit, initial_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy import decide
from rankguard_operator.core.spec.parse import parse_spec
from tests.unit.core.policy_world import DOC, inp, term

# Llama-3-70B at TP4 (policy_world's service): 80 layers x 2 KV heads of 128 per rank, bf16
PER_TOKEN = 81_920
MML = 8192


@pytest.mark.parametrize(("release", "block"), [("0.33.0", 16), ("0.34.0", 64)])
def test_a_shrink_below_the_releases_floor_degrades_at_that_floor(release: str, block: int) -> None:
    spec = parse_spec({**DOC, "image": f"vllm/vllm-openai:v{release}"})
    plan = initial_plan(spec)
    assert plan is not None
    floor = (MML // block + 1) * block * PER_TOKEN
    assert plan.min_kv_cache_memory_bytes == floor and block_unit(plan) == block * PER_TOKEN
    # 0.34's floor plus two 16-token blocks: above either floor, and a 2 GiB OOM takes it below both
    near = ServingFlags(kv_cache_memory_bytes=(MML // 64 + 1) * 64 * PER_TOKEN + 2 * 16 * PER_TOKEN)
    d = decide(inp(spec=spec, plan=plan, current=near, new_terminations=[term(flags=near)]))
    assert (d.action, d.reason) == ("degrade", "BudgetAtFloor")
    assert d.flags.kv_cache_memory_bytes == floor
    assert "one request of maxModelLen 8192 tokens" in d.message
