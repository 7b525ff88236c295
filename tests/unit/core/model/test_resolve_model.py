"""Model shapes: catalog, config.json, overrides, and the errors a person can act on."""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_operator.core.model.catalog import CATALOG, catalog_key, lookup_catalog
from rankguard_operator.core.model.hf_config import shape_from_hf_config
from rankguard_operator.core.model.resolve import REQUIRED_OVERRIDE_KEYS, resolve_model
from rankguard_operator.core.model.shape import InvalidShapeError, ModelShape, UnknownModelError
from rankguard_operator.core.spec.crd import SHAPE_OVERRIDE_KEYS

# shared/reference/vllm-memory-facts.md, "KV bytes" table
REFERENCE_TABLE = [
    # key, vocab, hidden, layers, heads, kv heads, intermediate, experts, top-k
    ("llama-3-8b", 128256, 4096, 32, 32, 8, 14336, 0, 0),
    ("llama-3-70b", 128256, 8192, 80, 64, 8, 28672, 0, 0),
    ("llama-3.1-405b", 128256, 16384, 126, 128, 8, 53248, 0, 0),
    ("mixtral-8x7b", 32000, 4096, 32, 32, 8, 14336, 8, 2),
]


@pytest.mark.parametrize("row", REFERENCE_TABLE, ids=[r[0] for r in REFERENCE_TABLE])
def test_catalog_matches_reference_table(row: tuple[str, int, int, int, int, int, int, int, int]) -> None:
    key, vocab, hidden, layers, heads, kv, inter, experts, topk = row
    s = CATALOG[key]
    assert (s.vocab_size, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size) == (
        vocab,
        hidden,
        layers,
        heads,
        kv,
        inter,
    )
    assert (s.num_experts, s.experts_per_token) == (experts, topk)
    assert s.head_dim == 128  # "head_dim is 128 for all of these"
    assert s.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("key", "published_billions"),
    [
        ("llama-3-8b", 8.03),
        ("llama-3-70b", 70.55),
        ("llama-3.1-405b", 405.85),
        ("qwen2.5-72b", 72.71),
        ("mixtral-8x7b", 46.70),
    ],
)
def test_catalog_parameter_counts_match_published_sizes(key: str, published_billions: float) -> None:
    # if any figure of the shape were wrong, the parameter count would be off by far more than 0.1 %
    assert CATALOG[key].num_params() / 1e9 == pytest.approx(published_billions, rel=1e-3)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("meta-llama/Meta-Llama-3-70B", "llama-3-70b"),
        ("meta-llama/Meta-Llama-3-70B-Instruct", "llama-3-70b"),
        ("META-LLAMA/META-LLAMA-3-70B-INSTRUCT", "llama-3-70b"),
        ("meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
        ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-405B-Instruct", "llama-3.1-405b"),
        ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
        ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
        ("/models/llama3-70b/", "llama-3-70b"),
        ("Llama-3-70B", "llama-3-70b"),
    ],
)
def test_names_map_to_catalog_entries(name: str, key: str) -> None:
    assert catalog_key(name) == key
    shape = lookup_catalog(name)
    assert shape is not None and shape.name == key
    resolved = resolve_model(name)
    assert resolved.name == name  # keeps the name the user gave
    assert resolved.num_params() == CATALOG[key].num_params()


def test_long_context_variants_keep_their_max_position_embeddings() -> None:
    assert resolve_model("meta-llama/Meta-Llama-3-70B").max_position_embeddings == 8192
    assert resolve_model("meta-llama/Llama-3.1-70B-Instruct").max_position_embeddings == 131072


@pytest.mark.parametrize(
    "name",
    [
        "meta-llama/Llama-3.1-405B-Instruct-FP8",
        "Qwen/Qwen2.5-72B-Instruct-AWQ",
        "acme/unheard-of-13b",
        "llama-3-71b",
    ],
)
def test_unknown_model_error_says_what_to_provide(name: str) -> None:
    # quantised checkpoints are deliberately not matched: their weights differ in size
    with pytest.raises(UnknownModelError) as err:
        resolve_model(name)
    msg = str(err.value)
    assert repr(name) in msg
    assert "spec.model.shape" in msg
    for key in REQUIRED_OVERRIDE_KEYS:
        assert key in msg
    assert "spec.model.configMap" in msg
    assert "--config" in msg


def _full_override(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "vocabSize": 50000,
        "hiddenSize": 5120,
        "numLayers": 40,
        "numHeads": 40,
        "numKVHeads": 8,
        "intermediateSize": 13824,
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not None}


def test_complete_override_makes_an_unknown_model_plannable() -> None:
    s = resolve_model("acme/unheard-of-13b", _full_override(tieWordEmbeddings=True))
    assert s.name == "acme/unheard-of-13b"
    assert (s.vocab_size, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads) == (
        50000,
        5120,
        40,
        40,
        8,
    )
    assert s.head_dim == 128
    assert s.tie_word_embeddings is True


def test_incomplete_override_of_unknown_model_names_the_missing_fields() -> None:
    with pytest.raises(UnknownModelError, match=r"missing numHeads, numKVHeads"):
        resolve_model("acme/x", _full_override(numHeads=None, numKVHeads=None))


def test_partial_override_layers_on_the_catalog() -> None:
    base = CATALOG["llama-3-70b"]
    s = resolve_model("meta-llama/Meta-Llama-3-70B", {"numLayers": 40})
    assert s.num_layers == 40
    assert (s.hidden_size, s.num_heads, s.head_dim) == (base.hidden_size, base.num_heads, base.head_dim)


def test_override_changing_hidden_size_re_derives_head_dim() -> None:
    s = resolve_model("meta-llama/Meta-Llama-3-70B", {"hiddenSize": 4096, "numHeads": 32})
    assert s.head_dim == 128
    s = resolve_model("meta-llama/Meta-Llama-3-70B", {"hiddenSize": 4096})
    assert s.head_dim == 64


def test_override_with_unknown_key_is_rejected() -> None:
    with pytest.raises(InvalidShapeError, match="numLayerz"):
        resolve_model("meta-llama/Meta-Llama-3-70B", {"numLayerz": 3})


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"numHeads": 40, "numKVHeads": 6}, "must be a multiple of num_kv_heads"),
        ({"numLayers": 0}, "num_layers must be a positive integer"),
        ({"vocabSize": -1}, "vocab_size must be a positive integer"),
        ({"hiddenSize": 5001, "numHeads": 40}, "give head_dim"),
        ({"hiddenSize": True}, "hidden_size must be a positive integer"),
        ({"numExperts": 8}, "must both be set"),
        ({"numExperts": 2, "expertsPerToken": 4}, "exceeds"),
    ],
)
def test_invalid_shapes_are_rejected_with_the_reason(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidShapeError, match=fragment):
        resolve_model("acme/x", _full_override(**changes))


def test_explicit_head_dim_allows_uneven_hidden_size() -> None:
    s = resolve_model("acme/x", _full_override(hiddenSize=5001, numHeads=40, headDim=128))
    assert s.head_dim == 128


def test_override_keys_map_to_shape_fields() -> None:
    fields = set(ModelShape.__dataclass_fields__)
    assert set(SHAPE_OVERRIDE_KEYS.values()) <= fields
    assert set(REQUIRED_OVERRIDE_KEYS) <= set(SHAPE_OVERRIDE_KEYS)


# --- config.json ----------------------------------------------------------------------------

LLAMA3_70B_CONFIG: dict[str, Any] = {
    "_name_or_path": "meta-llama/Meta-Llama-3-70B",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

MIXTRAL_CONFIG: dict[str, Any] = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}


def _arch(s: ModelShape) -> tuple[Any, ...]:
    return (
        s.vocab_size,
        s.hidden_size,
        s.num_layers,
        s.num_heads,
        s.num_kv_heads,
        s.intermediate_size,
        s.tie_word_embeddings,
        s.head_dim,
        s.num_experts,
        s.experts_per_token,
        s.qkv_bias,
    )


def test_config_json_of_a_catalog_model_gives_the_catalog_shape() -> None:
    s = shape_from_hf_config(LLAMA3_70B_CONFIG)
    assert s.name == "meta-llama/Meta-Llama-3-70B"
    assert _arch(s) == _arch(CATALOG["llama-3-70b"])
    assert s.max_position_embeddings == 8192
    assert s.torch_dtype == "bfloat16"
    assert s.quant_bits is None


def test_mixtral_config_is_moe() -> None:
    s = shape_from_hf_config(MIXTRAL_CONFIG, name="mixtral")
    assert _arch(s) == _arch(CATALOG["mixtral-8x7b"])
    assert s.is_moe


def test_qwen_moe_config_uses_expert_sizes() -> None:
    doc = {
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
    }
    s = shape_from_hf_config(doc)
    assert (s.num_experts, s.experts_per_token, s.intermediate_size) == (60, 4, 1408)
    assert s.shared_expert_intermediate_size == 5632
    assert s.qkv_bias  # Qwen2 attention has q/k/v biases
    assert s.num_params() / 1e9 == pytest.approx(14.3, rel=0.01)  # Qwen1.5-MoE-A2.7B: 14.3B total


def test_config_without_kv_heads_is_multi_head_attention() -> None:
    doc = {k: v for k, v in LLAMA3_70B_CONFIG.items() if k != "num_key_value_heads"}
    assert shape_from_hf_config(doc).num_kv_heads == 64


def test_config_without_tie_flag_counts_an_untied_head() -> None:
    # untied over-counts weights, so the KV budget errs small, never large
    doc = {k: v for k, v in LLAMA3_70B_CONFIG.items() if k != "tie_word_embeddings"}
    assert shape_from_hf_config(doc).tie_word_embeddings is False


def test_multimodal_config_reads_text_config() -> None:
    doc = {
        "model_type": "mllama",
        "text_config": dict(LLAMA3_70B_CONFIG),
        "vision_config": {"hidden_size": 1280},
    }
    shape = shape_from_hf_config(doc)
    assert _arch(shape) == _arch(CATALOG["llama-3-70b"])
    # mllama's cross-attention layers are not modelled, nor is a tower whose size is not stated
    assert "mllama" in shape.unmodelled


@pytest.mark.parametrize(
    ("quant", "bits"),
    [
        ({"quant_method": "fp8"}, 8),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, 4),
        ({"quant_method": "gptq", "bits": 8}, 8),
    ],
)
def test_quantization_config(quant: dict[str, Any], bits: int) -> None:
    shape = shape_from_hf_config({**LLAMA3_70B_CONFIG, "quantization_config": quant})
    assert shape.quant is not None and shape.quant.bits == bits
    assert shape.unmodelled == ""


def test_unknown_quantization_is_unmodelled_not_guessed() -> None:
    shape = shape_from_hf_config({**LLAMA3_70B_CONFIG, "quantization_config": {"quant_method": "mystery"}})
    assert shape.quant is None
    assert "'mystery' is not modelled" in shape.unmodelled


def test_explicit_head_dim_in_config_wins() -> None:
    s = shape_from_hf_config({**LLAMA3_70B_CONFIG, "head_dim": 256})
    assert s.head_dim == 256


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("num_attention_heads", None, "lacks 'num_attention_heads'"),
        ("hidden_size", None, "lacks 'hidden_size'"),
        ("vocab_size", "128256", "vocab_size must be a positive integer"),
        ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer"),
        ("num_key_value_heads", 7, "multiple of num_kv_heads"),
    ],
)
def test_bad_config_json_is_explained(key: str, value: Any, fragment: str) -> None:
    doc = {k: v for k, v in LLAMA3_70B_CONFIG.items() if k != key}
    if value is not None:
        doc[key] = value
    with pytest.raises(InvalidShapeError, match=fragment):
        shape_from_hf_config(doc)


def test_config_must_be_an_object() -> None:
    with pytest.raises(InvalidShapeError, match="JSON object"):
        shape_from_hf_config([1, 2])  # type: ignore[arg-type]


def test_resolve_prefers_config_over_catalog_and_override_over_config() -> None:
    doc = {**LLAMA3_70B_CONFIG, "num_hidden_layers": 10}
    assert resolve_model("meta-llama/Meta-Llama-3-70B", hf_config=doc).num_layers == 10
    assert resolve_model("meta-llama/Meta-Llama-3-70B", {"numLayers": 12}, hf_config=doc).num_layers == 12
    # a config.json makes an unknown name plannable
    assert resolve_model("acme/private", hf_config=doc).name == "acme/private"
