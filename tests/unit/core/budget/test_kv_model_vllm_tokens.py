"""The capacity a budget buys (kv_model.capacity_for_budget, what Plan.capacity and
status.capacity report) counts tokens as vLLM 0.34 counts them for models that mix sliding-window
and full attention, and for a model of sliding windows only.

The expected figures are written here from vLLM 0.34's own formulas, not from rankguard's code
(paths under ~/.cache/rankguard/vllm-0.34.0/lib/python3.11/site-packages/vllm/v1/):
- core/kv_cache_planning.py:567-600 (_get_kv_cache_groups_uniform_page_size): the layers of
  each attention type split into groups of `group_size` layers (the least count of a type, or
  the largest when under 1.5x it), layer i going to group i % n;
- core/kv_cache_planning.py:620-631 (_get_kv_cache_bytes_per_block) and :724: a block id costs
  the widest group's pages, num_blocks = available_memory // bytes_per_block;
- core/kv_cache_utils.py:1082-1114 (get_max_concurrency_for_kv_cache_config): max concurrency =
  num_blocks / the sum over groups of cdiv(max_memory_usage_bytes, page);
- kv_cache_interface.py:654-659 (FullAttentionSpec.max_memory_usage_bytes): cdiv(max_model_len,
  block_size) pages; :932-969 (SlidingWindowSpec): cdiv(min(window - 1 + max_in_flight_tokens,
  max_model_len), block_size) + 1 pages, max_in_flight_tokens = 2 x max_num_batched_tokens
  (config/vllm.py:569-577, async scheduling's two batches);
- core/kv_cache_utils.py:1141-1149 (get_kv_cache_capacity): the "KV cache size: N tokens" it
  prints is int(max_concurrency x max_model_len).

Not `num_blocks // len(groups) x block_size` (what vLLM printed before the group-aware
capacity): with 7 groups of gemma-3 that would be several times off.
"""

from __future__ import annotations

import pytest

from rankguard_operator.core.budget.kv_model import capacity_for_budget
from rankguard_operator.core.model.catalog import lookup_catalog
from rankguard_operator.core.model.hf_config import shape_from_hf_config
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.units import GiB

BLOCK = 64  # vLLM 0.34's CacheConfig.DEFAULT_BLOCK_SIZE (engine.json default_block_size)
BATCHED = 8192
IN_FLIGHT = 2 * BATCHED
BF16 = 2
LAYOUT = {"dtype": "bfloat16", "block_size": BLOCK, "max_num_batched_tokens": BATCHED}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _shape(name: str) -> ModelShape:
    shape = lookup_catalog(name)
    assert shape is not None, name
    return shape


def _vllm(
    budget: int,
    mml: int,
    *,
    groups: list[tuple[str, int]],
    page: int,
    window: int = 0,
) -> tuple[int, float]:
    """vLLM 0.34's (tokens, max concurrency) for groups of (kind, layers) sharing one page size."""
    bytes_per_block = max(layers * page for _, layers in groups)
    num_blocks = budget // bytes_per_block
    per_request = sum(
        _cdiv(mml, BLOCK) if kind == "full" else _cdiv(min(window - 1 + IN_FLIGHT, mml), BLOCK) + 1
        for kind, _ in groups
    )
    concurrency = num_blocks / per_request
    return int(concurrency * mml), concurrency


@pytest.mark.parametrize("budget", [3 * GiB, 20 * GiB + 12345])
@pytest.mark.parametrize("mml", [8192, 131072])
def test_gpt_oss_half_sliding_counts_two_groups_of_twelve(budget: int, mml: int) -> None:
    shape = _shape("openai/gpt-oss-20b")  # 24 layers alternating sliding 128 / full, 8 KV heads of 64
    page = BLOCK * 2 * 8 * 64 * BF16
    want = _vllm(budget, mml, groups=[("sliding", 12), ("full", 12)], page=page, window=128)
    cap = capacity_for_budget(shape, 1, budget, max_model_len=mml, **LAYOUT)
    assert cap.tokens == want[0]
    assert cap.max_concurrency == pytest.approx(want[1])


@pytest.mark.parametrize("budget", [1 * GiB, 9 * GiB + 777])
@pytest.mark.parametrize("mml", [4096, 32768])
def test_gemma3_five_to_one_counts_six_sliding_groups_and_one_full(budget: int, mml: int) -> None:
    shape = _shape("google/gemma-3-1b-it")  # 26 layers: full every 6th (4), sliding 512 (22)
    page = BLOCK * 2 * 1 * 256 * BF16
    # group_size = 4 (the full layers; 22 >= 1.5 x 4): 22 sliding -> cdiv(22, 4) = 6 groups
    groups = [("sliding", 4)] * 4 + [("sliding", 3)] * 2 + [("full", 4)]
    want = _vllm(budget, mml, groups=groups, page=page, window=512)
    cap = capacity_for_budget(shape, 1, budget, max_model_len=mml, **LAYOUT)
    assert cap.tokens == want[0]
    assert cap.max_concurrency == pytest.approx(want[1])
    # the pre-group-aware formula would say something else: the figures are not that one
    assert cap.tokens != (budget // (4 * page)) // 7 * BLOCK


# Mistral-7B-v0.1's published config.json (the fields a shape reads): every layer a 4096 window.
MISTRAL_V01 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("budget", [2 * GiB, 30 * GiB + 5])
@pytest.mark.parametrize("mml", [2048, 32768])
def test_a_model_of_sliding_windows_only_is_one_group(budget: int, mml: int) -> None:
    shape = shape_from_hf_config(MISTRAL_V01, "mistralai/Mistral-7B-v0.1")
    page = BLOCK * 2 * 8 * 128 * BF16
    want = _vllm(budget, mml, groups=[("sliding", 32)], page=page, window=4096)
    cap = capacity_for_budget(shape, 1, budget, max_model_len=mml, **LAYOUT)
    assert cap.tokens == want[0]
    assert cap.max_concurrency == pytest.approx(want[1])
