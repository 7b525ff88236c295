"""The tensors of a Hugging Face checkpoint, derived from its config.json: PURE.

A small model of the Llama family's layout, enough for the fake vLLM to "download" header-only
safetensors files that agree with a scenario's model: the embedding, the LM head unless tied,
per decoder layer q/k/v/o (with biases for Qwen2-style attention), the dense MLP
(gate/up/down) or a mixture of experts (router, experts, shared experts), the norms.
Multi-latent attention, vision towers and quantised checkpoints are not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "half": ("F16", 2), "float32": ("F32", 4)}
_QKV_BIAS_MODELS = ("qwen2", "qwen2_moe")


class CheckpointConfigError(ValueError):
    """config.json lacks what the tensor layout needs."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors' name: "BF16", "F16", "F32"
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (multimodal configs nest it as `text_config`)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise CheckpointConfigError(f"config.json: {key} must be a positive integer, got {v!r:.40}")
    return v


def head_dim(cfg: Mapping[str, Any]) -> int:
    if cfg.get("head_dim") is not None:
        return _int(cfg, "head_dim")
    return _int(cfg, "hidden_size") // _int(cfg, "num_attention_heads")


def _experts(cfg: Mapping[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            return _int(cfg, key)
    return 0


def _is_moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    if i < int(cfg.get("first_k_dense_replace") or 0) or i in (cfg.get("mlp_only_layers") or []):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (i + 1) % step == 0


def checkpoint_tensors(config: Mapping[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in the order Hugging Face writes them."""
    cfg = text_config(config)
    dtype_name = str(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if dtype_name not in DTYPES:
        raise CheckpointConfigError(f"config.json: dtype {dtype_name!r:.40} not in {', '.join(DTYPES)}")
    dtype, size = DTYPES[dtype_name]
    hidden, vocab = _int(cfg, "hidden_size"), _int(cfg, "vocab_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    hd = head_dim(cfg)
    experts = _experts(cfg)
    out: list[TensorSpec] = []

    def add(name: str, *shape: int) -> None:
        out.append(TensorSpec(name, dtype, shape, size))

    def mlp(prefix: str, inter: int) -> None:
        add(f"{prefix}.gate_proj.weight", inter, hidden)
        add(f"{prefix}.up_proj.weight", inter, hidden)
        add(f"{prefix}.down_proj.weight", hidden, inter)

    add("model.embed_tokens.weight", vocab, hidden)
    bias = bool(cfg.get("attention_bias")) or cfg.get("model_type") in _QKV_BIAS_MODELS
    for i in range(_int(cfg, "num_hidden_layers")):
        p = f"model.layers.{i}"
        add(f"{p}.input_layernorm.weight", hidden)
        for proj, rows in (("q_proj", heads * hd), ("k_proj", kv_heads * hd), ("v_proj", kv_heads * hd)):
            add(f"{p}.self_attn.{proj}.weight", rows, hidden)
            if bias:
                add(f"{p}.self_attn.{proj}.bias", rows)
        add(f"{p}.self_attn.o_proj.weight", hidden, heads * hd)
        add(f"{p}.post_attention_layernorm.weight", hidden)
        if experts and _is_moe_layer(cfg, i):
            inter = _int(cfg, "moe_intermediate_size", cfg.get("intermediate_size"))
            add(f"{p}.mlp.gate.weight", experts, hidden)
            for e in range(experts):
                mlp(f"{p}.mlp.experts.{e}", inter)
            if cfg.get("shared_expert_intermediate_size"):
                mlp(f"{p}.mlp.shared_expert", _int(cfg, "shared_expert_intermediate_size"))
                add(f"{p}.mlp.shared_expert_gate.weight", 1, hidden)
            elif cfg.get("n_shared_experts"):
                mlp(f"{p}.mlp.shared_experts", _int(cfg, "n_shared_experts") * inter)
        else:
            mlp(f"{p}.mlp", _int(cfg, "intermediate_size"))
    add("model.norm.weight", hidden)
    if not (cfg.get("tie_word_embeddings") or config.get("tie_word_embeddings")):
        add("lm_head.weight", vocab, hidden)
    return out
