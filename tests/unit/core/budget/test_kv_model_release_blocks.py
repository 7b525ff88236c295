"""The block size, and with it the KV floor and the token figures, are the engine's release's: vLLM
0.34 defaults to 64-token blocks where 0.33 used 16 (each snapshot's engine.json), resolved against
the attention backend's block sizes as vLLM resolves them (platforms/interface.py
update_block_size_for_backend), the user's spec.engine.blockSize otherwise (issue 51).

The figures below are Llama-3-8B's (32 layers, 8 KV heads of 128, bf16: 131,072 KV bytes per token
at TP1), so each floor is (max_model_len / block size + the null block) x block size x that.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.bounds import engine_block_size, initial_plan, kv_floor
from rankguard_operator.core.budget.fits import BudgetDoesNotFit, check_budget_fits, request_floor
from rankguard_operator.core.budget.kv_model import MLA_BLOCK_SIZE, default_block_size
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.resolve import resolve, resolve_model
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.status.build import budget_status
from rankguard_operator.core.units import GiB, MiB

OLD = vllm_snapshots.load("0.33.0")  # the last release with 16-token blocks
NEW = vllm_snapshots.load("0.34.0")  # the first with 64
PER_TOKEN = 131_072  # Llama-3-8B, TP1, bf16
MML = 8192

DOC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-8B"},
    "tensorParallelSize": 1,
    "engine": {"maxModelLen": MML},
    "memory": {"gpuMemoryBytes": 80 * GiB},
}


def spec(
    release: str, *, engine: dict[str, Any] | None = None, memory: dict[str, Any] | None = None
) -> ServiceSpec:
    doc = copy.deepcopy(DOC)
    doc["image"] = f"vllm/vllm-openai:v{release}"
    doc["engine"].update(engine or {})
    doc["memory"].update(memory or {})
    return parse_spec(doc)


def floor_at(block: int, null_blocks: int = 1) -> int:
    return (-(-MML // block) + null_blocks) * block * PER_TOKEN


def test_the_snapshots_record_the_change_the_budget_reads() -> None:
    assert (OLD.default_block_size, NEW.default_block_size) == (16, 64)
    assert OLD.null_blocks == NEW.null_blocks == 1


@pytest.mark.parametrize(("release", "block"), [(OLD, 16), (NEW, 64)])
def test_default_block_size_is_the_releases_own_default(release: vllm_snapshots.Snapshot, block: int) -> None:
    llama = resolve_model("meta-llama/Meta-Llama-3-8B")
    assert default_block_size(llama, release) == release.default_block_size == block
    # MLA: FlashMLA takes multiples of 64 only, so 64 under either default
    deepseek = resolve_model("deepseek-ai/DeepSeek-V3")
    assert deepseek.mla is not None and default_block_size(deepseek, release) == MLA_BLOCK_SIZE


def test_a_default_the_standard_backend_does_not_take_falls_to_its_smallest_size() -> None:
    """get_preferred_block_size: a default the backend refuses gives way to the smallest size it
    takes (a release is built here from 0.34's record with FLASH_ATTN's sizes cut to 128 and up)."""
    sizes = {**NEW.surface["attention_block_sizes"], "FLASH_ATTN": [128, 256, 512]}
    odd = replace(NEW, surface={**NEW.surface, "attention_block_sizes": sizes})
    assert default_block_size(resolve_model("meta-llama/Meta-Llama-3-8B"), odd) == 128


@pytest.mark.parametrize(("release", "block"), [("0.33.0", 16), ("0.34.0", 64), ("0.35.2", 64)])
def test_the_engine_block_size_is_the_images_release_or_the_users(release: str, block: int) -> None:
    """From the image's tag, as the spec's other engine rules (an unrecorded release: the nearest
    older snapshot); spec.engine.blockSize wins on every release."""
    shape = resolve_model("meta-llama/Meta-Llama-3-8B")
    assert engine_block_size(spec(release), shape) == block
    assert engine_block_size(spec(release, engine={"blockSize": 32}), shape) == 32


# The issue's range: a pinned budget that holds one 8,192-token request in 16-token blocks but not
# in 64-token ones (129 x 64 x 131,072 = 1,082,130,432 bytes).
LOW, HIGH = floor_at(16), floor_at(64) - 1


def test_the_issue_range_is_the_gap_between_the_two_floors() -> None:
    assert (LOW, HIGH) == (1_075_838_976, 1_082_130_431)


@pytest.mark.parametrize("pinned", [LOW, HIGH])
def test_a_pinned_budget_below_064s_floor_is_refused_on_034_and_accepted_on_033(pinned: int) -> None:
    """vLLM 0.34 refuses to start with it ("... KV cache is needed"): rankguard refuses it at apply
    time, naming the block size; 0.33 starts with it."""
    old = spec("0.33.0", memory={"kvCacheMemoryBytes": pinned})
    check_budget_fits(old, resolve(old), None)
    new = spec("0.34.0", memory={"kvCacheMemoryBytes": pinned})
    with pytest.raises(BudgetDoesNotFit) as refused:
        check_budget_fits(new, resolve(new), None)
    assert f"needs {floor_at(64)} bytes" in str(refused.value)
    assert "64-token blocks (vLLM 0.34.0's default for this model)" in str(refused.value)
    # its own floor it takes
    exact = spec("0.34.0", memory={"kvCacheMemoryBytes": floor_at(64)})
    check_budget_fits(exact, resolve(exact), None)


def test_a_user_block_size_sets_the_floor_on_034() -> None:
    """--block-size 16 on 0.34: the engine uses 16-token blocks, so 0.33's floor holds again."""
    s = spec("0.34.0", engine={"blockSize": 16}, memory={"kvCacheMemoryBytes": LOW})
    check_budget_fits(s, resolve(s), None)
    assert request_floor(s, resolve(s)) == LOW


@pytest.mark.parametrize(("release", "block"), [("0.33.0", 16), ("0.34.0", 64)])
def test_the_plans_floor_and_block_unit_follow_the_release(release: str, block: int) -> None:
    """The shrink lever's floor (budget.kv_floor: the plan's one request at max_model_len) and the
    unit every budget is rounded to."""
    s = spec(release)
    plan = initial_plan(s)
    assert plan is not None
    assert plan.inputs.block_size == block
    assert kv_floor(s, plan) == plan.min_kv_cache_memory_bytes == floor_at(block)
    assert plan.block_bytes == block * PER_TOKEN
    assert plan.kv_cache_memory_bytes % (block * PER_TOKEN) == 0


# 8 GiB plus three 16-token blocks: whole blocks at 16 tokens, a part block at 64
BUDGET = 8 * GiB + 3 * 16 * PER_TOKEN


@pytest.mark.parametrize(
    ("release", "blocks", "tokens"),
    [
        # 4,099 blocks of 16 tokens; vLLM prints int(4,099 / 512 x 8,192) tokens
        ("0.33.0", 4099, 65_584),
        # 1,024 blocks of 64 (the last three 16-token blocks make no 64-token one)
        ("0.34.0", 1024, 65_536),
    ],
)
def test_status_token_figures_count_the_releases_blocks(release: str, blocks: int, tokens: int) -> None:
    s = spec(release)
    plan = initial_plan(s)
    doc = budget_status(plan, ServingFlags(kv_cache_memory_bytes=BUDGET), s)
    assert (doc["blocks"], doc["tokens"]) == (blocks, tokens)
    assert plan is not None and plan.capacity(BUDGET).tokens == tokens
    assert BUDGET - 8 * GiB == 6 * MiB
