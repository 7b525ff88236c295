"""Families and quantisation formats, read from the published config.json files of the catalog
(operator/rankguard_operator/catalog, sources in its SOURCES.md): parameter counts against the
model cards, KV bytes per token against the attention each family really caches, and the
modules each quantised checkpoint keeps in 16-bit."""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_operator.core.budget.kv_model import kv_bytes_per_token, stage_kv_layout
from rankguard_operator.core.budget.memory_model import weight_bytes
from rankguard_operator.core.model.catalog import CATALOG, CATALOG_ENTRIES
from rankguard_operator.core.model.hf_config import shape_from_hf_config
from rankguard_operator.core.model.shape import InvalidShapeError
from rankguard_operator.core.units import GiB

# Parameter counts the model cards publish (billions). A wrong expert count, a missed shared
# expert or an MLA projection miscounted would move these by far more than 2 %.
PUBLISHED_PARAMS = [
    ("llama-3.1-8b", 8.03),
    ("llama-3.1-70b", 70.6),
    ("qwen3-8b", 8.19),
    ("phi-4", 14.7),
    ("mixtral-8x7b", 46.7),
    ("mixtral-8x22b", 141.0),
    ("qwen1.5-moe-a2.7b", 14.3),
    ("qwen3-30b-a3b", 30.5),
    ("qwen3-235b-a22b", 235.0),
    ("deepseek-v2-lite", 15.7),
    ("deepseek-v3", 671.0),
    ("kimi-k2", 1026.0),
    ("llama-4-scout-17b-16e", 109.0),
    ("llama-4-maverick-17b-128e", 400.0),
    ("gpt-oss-20b", 20.9),
    ("gpt-oss-120b", 116.8),
    ("gemma-2-9b", 9.24),
    ("gemma-2-27b", 27.2),
    ("gemma-3-1b", 1.0),
    ("qwen3-next-80b-a3b-thinking", 80.0),
    ("qwen2.5-vl-7b", 8.29),
]


@pytest.mark.parametrize(("key", "billions"), PUBLISHED_PARAMS, ids=[k for k, _ in PUBLISHED_PARAMS])
def test_parameter_counts_match_the_model_cards(key: str, billions: float) -> None:
    assert CATALOG[key].num_params() / 1e9 == pytest.approx(billions, rel=0.02)


def test_every_catalog_file_reads_and_says_where_it_came_from() -> None:
    assert len(CATALOG) >= 30
    for key, entry in CATALOG_ENTRIES.items():
        assert entry["source"], key
        assert CATALOG[key].num_layers > 0


def test_mla_caches_one_latent_per_token_on_every_rank() -> None:
    lite = CATALOG["deepseek-v2-lite"]
    assert lite.mla is not None
    # (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes x 27 layers, not per-head K/V
    assert kv_bytes_per_token(lite, 1) == (512 + 64) * 2 * 27 == 31_104
    assert kv_bytes_per_token(lite, 2) == kv_bytes_per_token(lite, 1)  # replicated, not split
    # its routed and shared experts are weights too: ~29.3 GiB in bf16, not 5
    assert weight_bytes(lite, 1) / GiB == pytest.approx(29.3, rel=0.02)


def test_deepseek_v3_dense_first_layers_and_fp8_blocks() -> None:
    v3 = CATALOG["deepseek-v3"]
    assert v3.moe_layers[:3] == (False, False, False) and all(v3.moe_layers[3:])
    assert v3.quant is not None and (v3.quant.method, v3.quant.bits, v3.quant.group_size) == (
        "fp8",
        8,
        128 * 128,
    )
    # ~1 byte per parameter, the bf16 embeddings and norms on top
    assert weight_bytes(v3, 8) * 8 / 671e9 == pytest.approx(1.0, abs=0.03)


def test_sliding_window_layers_follow_each_family() -> None:
    g2 = CATALOG["gemma-2-9b"]
    assert g2.layer_kinds[:4] == ("sliding", "full", "sliding", "full") and g2.sliding_window == 4096
    g3 = CATALOG["gemma-3-1b"]
    assert g3.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    oss = CATALOG["gpt-oss-120b"]
    assert set(oss.layer_kinds) == {"sliding", "full"} and oss.sliding_window == 128
    scout = CATALOG["llama-4-scout-17b-16e"]
    assert scout.layer_kinds[:4] == ("chunked", "chunked", "chunked", "full")
    assert scout.attention_chunk_size == 8192


def test_sliding_window_layers_need_fewer_blocks_per_request() -> None:
    g2 = CATALOG["gemma-2-9b"]
    full = stage_kv_layout(g2, 1, range(g2.num_layers))
    # a 32768-token request: the sliding half holds only its 4096-token window plus the tokens
    # of one scheduler step in flight, not the whole request
    dense = 2 * g2.num_kv_heads * g2.head_dim * 2 * g2.num_layers * 32768
    assert full.min_budget_bytes(32768) < 0.85 * dense


def test_hybrid_linear_attention_keeps_a_state_per_sequence() -> None:
    nxt = CATALOG["qwen3-next-80b-a3b-thinking"]
    assert nxt.layer_kinds.count("full") == 12 and nxt.layer_kinds.count("linear") == 36
    assert nxt.linear is not None
    # only the 12 full-attention layers cache per token: 2 KV heads x 256 x K,V x bf16
    assert kv_bytes_per_token(nxt, 1) == 12 * 2 * 2 * 256 * 2


def test_multimodal_checkpoints_count_their_vision_tower() -> None:
    vl = CATALOG["qwen2.5-vl-7b"]
    assert 0.6e9 < vl.vision_params < 0.75e9  # Qwen2.5-VL's ViT and merger (~0.67B)
    assert weight_bytes(vl, 1) > 2 * (vl.num_params() - vl.vision_params)


def test_tied_embeddings_default_per_family() -> None:
    assert CATALOG["gemma-2-9b"].tie_word_embeddings  # Gemma's config leaves it to the default
    assert not CATALOG["llama-3.1-8b"].tie_word_embeddings


def test_mxfp4_keeps_attention_router_embeddings_in_16_bit() -> None:
    q = CATALOG["gpt-oss-120b"].quant
    assert q is not None and q.method == "mxfp4"
    assert q.bits_for("model.layers.0.self_attn.q_proj") is None
    assert q.bits_for("model.layers.0.mlp.experts") == 4
    # vLLM pads the experts for its MXFP4 kernels: heavier than the 60.8 GiB checkpoint
    assert weight_bytes(CATALOG["gpt-oss-120b"], 1) / GiB > 60.8


def test_fp8_ignore_lists_are_matched_under_a_wrapper_prefix() -> None:
    scout = CATALOG["llama-4-scout-17b-16e-instruct-fp8-dynamic"]
    q = scout.quant
    assert q is not None and q.bits == 8
    # the checkpoint names language_model.model.layers.N.self_attn.*: kept in bf16
    assert q.bits_for("model.layers.0.self_attn.q_proj") is None
    assert q.bits_for("model.layers.0.mlp.experts") == 8
    # lighter than bf16, heavier than all-FP8
    bf16 = weight_bytes(CATALOG["llama-4-scout-17b-16e"], 1)
    assert 0.5 * bf16 < weight_bytes(scout, 1) < 0.6 * bf16


def test_modelopt_quantisation_comes_from_hf_quant_config() -> None:
    fp8 = CATALOG["llama-3.1-70b-instruct-fp8"]
    assert fp8.quant is not None and fp8.quant.method == "modelopt-fp8"
    assert weight_bytes(fp8, 1) < 0.55 * weight_bytes(CATALOG["llama-3.1-70b"], 1)


def test_block_fp8_with_16_bit_routers() -> None:
    q = CATALOG["qwen3-30b-a3b-fp8"].quant
    assert q is not None and q.group_size == 128 * 128
    assert q.bits_for("model.layers.3.mlp.gate") is None
    assert weight_bytes(CATALOG["qwen3-30b-a3b-fp8"], 1) / GiB == pytest.approx(29.0, rel=0.03)


@pytest.mark.parametrize(
    ("quant", "method", "bits", "group"),
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            "awq",
            4,
            128,
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
            "gptq",
            4,
            128,
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}
                },
                "ignore": ["lm_head"],
            },
            "compressed-tensors-w4",
            4,
            128,
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
            "bitsandbytes-4bit",
            4,
            64,
        ),
    ],
)
def test_int4_formats_are_sized_with_their_scales(
    quant: dict[str, Any], method: str, bits: int, group: int
) -> None:
    cfg = dict(CATALOG_ENTRIES["llama-3.1-70b"]["config"], quantization_config=quant)
    shape = shape_from_hf_config(cfg)
    assert shape.quant is not None and (shape.quant.method, shape.quant.bits, shape.quant.group_size) == (
        method,
        bits,
        group,
    )
    ratio = weight_bytes(shape, 1) / weight_bytes(CATALOG["llama-3.1-70b"], 1)
    assert 0.27 < ratio < 0.33  # 4 bits plus scales on the blocks; embeddings stay 16-bit


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_key_value_heads": 128}, "num_key_value_heads"),
        ({"hidden_size": 8191}, "num_attention_heads"),
        ({"num_hidden_layers": "80"}, "num_hidden_layers"),
        ({"vocab_size": 10**12}, "vocab_size"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
    ],
)
def test_bad_config_names_the_field(change: dict[str, Any], field: str) -> None:
    cfg = {**CATALOG_ENTRIES["llama-3.1-70b"]["config"], **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(InvalidShapeError, match=field):
        shape_from_hf_config(cfg)


def test_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidShapeError, match="JSON object"):
        shape_from_hf_config(["not", "a", "config"])


def test_unknown_architectures_are_marked_not_guessed() -> None:
    nemotron = CATALOG["nemotron-h-56b-base-8k"]
    assert "NemotronHForCausalLM" in nemotron.unmodelled
