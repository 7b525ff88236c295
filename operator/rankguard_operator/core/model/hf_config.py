"""A Hugging Face `config.json` turned into a `ModelShape`, family by family.

Families read here, by `model_type`: dense GQA (Llama 3.x, Mistral, Qwen2.5/3, Granite, Phi-3/4,
Gemma 1), MoE with shared experts and dense-first layers (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3/R1
and Kimi K2 with MLA, Llama 4 with interleaved MoE and chunked attention, gpt-oss), sliding-window
and alternating attention (Gemma 2/3, gpt-oss, Mistral's windowed layers), the gated delta-net
hybrid Qwen3-Next, and multimodal checkpoints (text model plus a vision tower's parameters).
Anything else still gets a shape when the usual fields are there, but `unmodelled` says why it
must not be planned from priors; the operator then measures first (never silently wrong).

Errors name the field: a config that is malformed, missing a field, out of bounds or
self-contradictory raises `InvalidShapeError`. Pure: no I/O (the caller reads the file, the
ConfigMap or the agent's report, and bounds its size).

(Over 450 lines because every family's config.json spelling is read here, one parser, so a
field means the same for every family; vision towers and defaults live in vision.py.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.model.quantization import QuantScheme, UnknownQuantization, quant_scheme
from rankguard_operator.core.model.shape import MLA, InvalidShapeError, LayerKind, LinearAttention, ModelShape
from rankguard_operator.core.model.vision import (
    ARCH_DEFAULTS,
    TEXT_TYPE,
    VISION_TYPE,
    vision_tower,
    with_defaults,
)

# model_type values whose memory the planner models (the text model's type for multimodal ones)
DENSE_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "granite",
        "phi3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "olmo2",
        "exaone",
    }
)
MOE_TYPES = frozenset(
    {
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "kimi_k2",
        "llama4_text",
        "gpt_oss",
        "qwen3_next",
    }
)
MULTIMODAL_TYPES = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "gemma3",
        "llama4",
        "mistral3",
        "llava",
        "llava_next",
        "kimi_vl",
    }
)
# Text models of multimodal wrappers that are a family read here under another name
# (vLLM 0.33 qwen3_vl.py / qwen3_vl_moe.py build Qwen3 / Qwen3-MoE decoders)
_TEXT_ALIASES = {"qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}
MODELLED_TYPES = DENSE_TYPES | MOE_TYPES | MULTIMODAL_TYPES
# Formats whose weights rankguard sizes but whose serving memory public logs contradict: measured
# first, not planned (docs/memory-model.md, "Misses").
UNMODELLED_QUANT = {
    "mxfp4": (
        "MXFP4 MoE (gpt-oss) is not modelled: on one H100, public vLLM logs show ~7.5 GiB per rank "
        "beyond the (padded) weights and activations (vllm#23278, vllm#27508)"
    ),
}

# Far beyond any published model; bigger numbers are garbage (or an attack), not a model.
_BOUNDS: dict[str, int] = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "num_hidden_layers": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 4096,
    "intermediate_size": 1 << 20,
    "max_position_embeddings": 1 << 27,
}
_DEFAULT_BOUND = 1 << 24
# The keys rankguard reads, with the nested objects it reads from; the status keeps just these.
_READ_KEYS = [
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "tie_word_embeddings",
    "max_position_embeddings",
    "torch_dtype",
    "dtype",
    "attention_bias",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "moe_layer_freq",
    "decoder_sparse_step",
    "mlp_only_layers",
    "interleave_moe_layer_step",
    "moe_layers",
    "intermediate_size_mlp",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "sliding_window_pattern",
    "attention_chunk_size",
    "no_rope_layers",
    "no_rope_layer_interval",
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "quantization_config",
    "hf_quant_config",
    "text_config",
    "vision_config",
    "depth",
    "embed_dim",
    "num_heads",
    "out_hidden_size",
    "spatial_merge_size",
    "patch_size",
    "in_chans",
    "in_channels",
    "num_channels",
    "temporal_patch_size",
    "hidden_act",
    "projector_hidden_act",
    "vision_output_dim",
    "mm_tokens_per_image",
    "image_size",
    "deepstack_visual_indexes",
    "num_position_embeddings",
    "merge_kernel_size",
    "init_pos_emb_height",
    "init_pos_emb_width",
    "projector_input_dim",
    "projector_output_dim",
    "spatial_patch_size",
    "_name_or_path",
]


def relevant_config(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a config.json the planner reads (nested text/vision configs likewise): what
    the operator keeps in status, so a shape learned from an agent survives without its pods."""
    out: dict[str, Any] = {}
    for k in _READ_KEYS:
        if k not in doc:
            continue
        v = doc[k]
        out[k] = relevant_config(v) if k in ("text_config", "vision_config") and isinstance(v, Mapping) else v
    return out


def canonical_json(doc: Any) -> str:
    """Compact JSON with sorted keys: one document, one text (status, annotations, hashes)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _int(
    doc: Mapping[str, Any], key: str, name: str, default: int | None = None, *, zero_ok: bool = False
) -> int:
    v = doc.get(key, default)
    if v is None:
        raise InvalidShapeError(
            f"config.json for {name!r} lacks {key!r}; it is needed to size weights and KV cache "
            f"(or give spec.model.shape / --shape instead)"
        )
    lo = 0 if zero_ok else 1
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        what = "a non-negative" if zero_ok else "a positive"
        raise InvalidShapeError(f"config.json for {name!r}: {key} must be {what} integer, got {v!r}")
    hi = _BOUNDS.get(key, _DEFAULT_BOUND)
    if v > hi:
        raise InvalidShapeError(
            f"config.json for {name!r}: {key} = {v} is beyond any real model (limit {hi})"
        )
    return v


def _opt_int(doc: Mapping[str, Any], key: str, name: str) -> int:
    return _int(doc, key, name, 0, zero_ok=True) if doc.get(key) is not None else 0


def _int_list(doc: Mapping[str, Any], key: str, name: str) -> list[int]:
    v = doc.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise InvalidShapeError(f"config.json for {name!r}: {key} must be a list of integers")
    return list(v)


_LAYER_TYPE_NAMES: dict[str, LayerKind] = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "linear",
}


def _listed_layer_kinds(types: Any, n: int, name: str) -> tuple[LayerKind, ...]:
    """`layer_types` as the config lists them, one per layer."""
    if not isinstance(types, list) or len(types) != n:
        raise InvalidShapeError(
            f"config.json for {name!r}: layer_types must list one type per layer ({n} layers)"
        )
    kinds: list[LayerKind] = []
    for t in types:
        if t not in _LAYER_TYPE_NAMES:
            raise InvalidShapeError(
                f"config.json for {name!r}: layer type {t!r} is not one of {', '.join(_LAYER_TYPE_NAMES)}"
            )
        kinds.append(_LAYER_TYPE_NAMES[t])
    return tuple(kinds)


def _llama4_layer_kinds(doc: Mapping[str, Any], n: int, name: str) -> tuple[LayerKind, ...]:
    """Llama 4's chunked attention: the layers without RoPE attend to everything."""
    no_rope = _int_list(doc, "no_rope_layers", name)
    if no_rope:
        if len(no_rope) != n:
            raise InvalidShapeError(f"config.json for {name!r}: no_rope_layers must have {n} entries")
        return tuple("chunked" if r else "full" for r in no_rope)
    step = _int(doc, "no_rope_layer_interval", name, 4)
    return tuple("full" if (i + 1) % step == 0 else "chunked" for i in range(n))


def _layer_kinds(doc: Mapping[str, Any], model_type: str, n: int, name: str) -> tuple[LayerKind, ...]:
    """Each layer's attention, from `layer_types` or the family's own pattern (() = all full)."""
    types = doc.get("layer_types")
    if types is not None:
        return _listed_layer_kinds(types, n, name)
    window = doc.get("sliding_window")
    windowed = isinstance(window, int) and window > 0 and doc.get("use_sliding_window", True) is not False
    if model_type == "gemma2" and windowed:
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    if model_type == "gemma3_text" and windowed:
        pattern = _int(doc, "sliding_window_pattern", name, 6)
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    if model_type == "llama4_text" and doc.get("attention_chunk_size"):
        return _llama4_layer_kinds(doc, n, name)
    if model_type == "qwen3_next":
        step = _int(doc, "full_attention_interval", name, 4)
        return tuple("full" if (i + 1) % step == 0 else "linear" for i in range(n))
    if windowed and model_type in ("mistral", "mixtral"):
        return tuple("sliding" for _ in range(n))
    return ()


def _moe(doc: Mapping[str, Any], model_type: str, n: int, name: str) -> dict[str, Any]:
    experts = 0
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if doc.get(key):
            experts = _int(doc, key, name)
            break
    if not experts:
        return {}
    top_k = _int(doc, "num_experts_per_tok", name)
    dense_width = 0
    mask: tuple[bool, ...] = ()
    if doc.get("moe_intermediate_size"):
        expert_width = _int(doc, "moe_intermediate_size", name)
        dense_width = _opt_int(doc, "intermediate_size", name)
    else:
        expert_width = _int(doc, "intermediate_size", name)
    shared = _opt_int(doc, "shared_expert_intermediate_size", name)
    if doc.get("n_shared_experts"):
        shared = _int(doc, "n_shared_experts", name) * expert_width
    if model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        first_dense = _opt_int(doc, "first_k_dense_replace", name)
        freq = _int(doc, "moe_layer_freq", name, 1)
        mask = tuple(i >= first_dense and i % freq == 0 for i in range(n))
    elif model_type == "llama4_text":
        shared = expert_width  # Llama 4: one shared expert as wide as a routed one
        dense_width = _opt_int(doc, "intermediate_size_mlp", name)
        listed = _int_list(doc, "moe_layers", name)
        if listed:
            mask = tuple(i in listed for i in range(n))
        else:
            step = _int(doc, "interleave_moe_layer_step", name, 1)
            mask = tuple((i + 1) % step == 0 for i in range(n))
    elif model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = _int(doc, "decoder_sparse_step", name, 1)
        dense_only = set(_int_list(doc, "mlp_only_layers", name))
        mask = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(n))
    if all(mask) or not mask:
        mask = ()
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "intermediate_size": expert_width,
        "shared_expert_intermediate_size": shared,
        "moe_layers": mask,
        "dense_intermediate_size": dense_width if dense_width != expert_width else 0,
    }


def _modelopt(hf_quant_config: Any) -> dict[str, Any] | None:
    """A ModelOpt checkpoint keeps its quantisation in hf_quant_config.json, not config.json
    (vLLM reads both; the agent and the catalog put it under `hf_quant_config`)."""
    q = hf_quant_config.get("quantization") if isinstance(hf_quant_config, Mapping) else None
    return {"quant_method": "modelopt", **q} if isinstance(q, Mapping) else None


def _architecture(doc: Mapping[str, Any], outer_type: str) -> str:
    archs = doc.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs and isinstance(archs[0], str) else outer_type


def _vision_config(doc: Mapping[str, Any], outer_type: str) -> Any:
    """A multimodal wrapper's vision_config with its class's defaults filled in (as given when it
    is not an object; None for a text-only model)."""
    vision = doc.get("vision_config")
    if vision is None and outer_type in VISION_TYPE:
        vision = {}  # the wrapper's config class builds its tower from the defaults
    if isinstance(vision, Mapping):
        vision = with_defaults(vision, str(vision.get("model_type") or VISION_TYPE.get(outer_type, "")))
    return vision


def _text_model_config(doc: Mapping[str, Any], outer_type: str, name: str) -> Mapping[str, Any]:
    """The language model's config: a multimodal wrapper's text_config (unless the wrapper states
    the sizes itself), with its class's defaults and what the wrapper passes down; else `doc`."""
    text = doc.get("text_config")
    if isinstance(text, Mapping) and ("hidden_size" not in doc or "num_hidden_layers" not in doc):
        text = with_defaults(text, str(text.get("model_type") or TEXT_TYPE.get(outer_type, "")))
        # the language model reads the tie from its own (text) config; a wrapper-level value
        # wins as transformers passes it down; else the wrapper class's default
        tie = doc.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        if tie is None:
            tie = ARCH_DEFAULTS.get(outer_type, {}).get("tie_word_embeddings", False)
        merged = {**text, "tie_word_embeddings": tie}
        for k in ("torch_dtype", "dtype", "quantization_config", "hf_quant_config"):
            if k not in merged and k in doc:
                merged[k] = doc[k]
        return merged
    if text is not None and not isinstance(text, Mapping):
        raise InvalidShapeError(f"config.json for {name!r}: text_config must be an object")
    return doc


def _text_model_type(doc: Mapping[str, Any], outer_type: str) -> str:
    """The family the language model belongs to (a wrapper's text model under its own name)."""
    model_type = str(doc.get("model_type", outer_type)).lower()
    if outer_type in TEXT_TYPE and model_type in (outer_type, ""):
        model_type = TEXT_TYPE[outer_type]
    return _TEXT_ALIASES.get(model_type, model_type)


def _attention_sizes(doc: Mapping[str, Any], name: str) -> tuple[int, int, int, int, int]:
    """(layers, hidden size, heads, KV heads, head_dim or 0 for hidden / heads), checked against
    one another."""
    n = _int(doc, "num_hidden_layers", name)
    hidden = _int(doc, "hidden_size", name)
    heads = _int(doc, "num_attention_heads", name)
    kv_heads = _int(doc, "num_key_value_heads", name, heads)
    if kv_heads > heads:
        raise InvalidShapeError(
            f"config.json for {name!r}: num_key_value_heads ({kv_heads}) exceeds "
            f"num_attention_heads ({heads})"
        )
    head_dim = _opt_int(doc, "head_dim", name)
    if not head_dim and hidden % heads:
        raise InvalidShapeError(
            f"config.json for {name!r}: num_attention_heads ({heads}) does not divide hidden_size "
            f"({hidden}) and no head_dim is given"
        )
    return n, hidden, heads, kv_heads, head_dim


def _mla(doc: Mapping[str, Any], name: str) -> MLA | None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), when the config has a KV LoRA rank."""
    if not doc.get("kv_lora_rank"):
        return None
    return MLA(
        kv_lora_rank=_int(doc, "kv_lora_rank", name),
        qk_rope_head_dim=_int(doc, "qk_rope_head_dim", name),
        qk_nope_head_dim=_int(doc, "qk_nope_head_dim", name),
        v_head_dim=_int(doc, "v_head_dim", name),
        q_lora_rank=_opt_int(doc, "q_lora_rank", name),
    )


def _linear_attention(doc: Mapping[str, Any], name: str) -> LinearAttention:
    """The gated delta-net layers' sizes (Qwen3-Next)."""
    return LinearAttention(
        num_key_heads=_int(doc, "linear_num_key_heads", name),
        num_value_heads=_int(doc, "linear_num_value_heads", name),
        key_head_dim=_int(doc, "linear_key_head_dim", name),
        value_head_dim=_int(doc, "linear_value_head_dim", name),
        conv_kernel=_int(doc, "linear_conv_kernel_dim", name),
    )


def _unmodelled_architecture(architecture: str, outer_type: str, model_type: str) -> str:
    """Why the planner cannot model this family (or wrapper), or ""."""
    wrapper_known = not outer_type or outer_type == model_type or outer_type in MODELLED_TYPES
    if model_type in MODELLED_TYPES and wrapper_known:
        return ""
    arch = architecture or model_type or "unknown"
    kind = outer_type if not wrapper_known else (model_type or "no model_type")
    return f"architecture {arch} ({kind}) is not modelled"


def _quantisation(doc: Mapping[str, Any]) -> tuple[QuantScheme | None, str]:
    """The checkpoint's quantisation, and why it is not modelled (or "")."""
    try:
        quant = quant_scheme(doc.get("quantization_config") or _modelopt(doc.get("hf_quant_config")))
    except UnknownQuantization as exc:
        return None, f"the checkpoint's quantisation is not modelled: {exc}"
    if quant is not None and quant.method in UNMODELLED_QUANT:
        return quant, UNMODELLED_QUANT[quant.method]
    return quant, ""


def _vision_figures(
    outer_type: str, vision: Any, doc: Mapping[str, Any], hidden: int
) -> tuple[tuple[int, int, int], str]:
    """The vision tower's (params, replicated params, heads), and why it is not modelled (or "")."""
    if not isinstance(vision, Mapping):
        return (0, 0, 0), ""
    tower = vision_tower(outer_type, vision, doc, hidden)
    if tower is None:
        return (0, 0, 0), "the vision tower's size is not stated in vision_config (depth, hidden_size)"
    return tower, ""


def _max_position(doc: Mapping[str, Any]) -> int | None:
    max_pos = doc.get("max_position_embeddings")
    return None if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos <= 0 else max_pos


def shape_from_hf_config(doc: Any, name: str | None = None) -> ModelShape:
    """Build a shape from a Hugging Face `config.json` document (already parsed). Raises
    InvalidShapeError naming the field when the document cannot describe a model."""
    if not isinstance(doc, Mapping):
        raise InvalidShapeError(f"config.json must be a JSON object, got {type(doc).__name__}")
    model_name = name or str(doc.get("_name_or_path") or doc.get("model_type") or "config.json")
    outer_type = str(doc.get("model_type", "")).lower()
    architecture = _architecture(doc, outer_type)
    vision = _vision_config(doc, outer_type)
    doc = _text_model_config(doc, outer_type, model_name)
    model_type = _text_model_type(doc, outer_type)

    n, hidden, heads, kv_heads, head_dim = _attention_sizes(doc, model_name)
    mla = _mla(doc, model_name)
    kinds = _layer_kinds(doc, model_type, n, model_name)
    linear = _linear_attention(doc, model_name) if "linear" in kinds else None
    moe = _moe(doc, model_type, n, model_name)
    intermediate = moe.pop("intermediate_size", None) or _int(doc, "intermediate_size", model_name)
    arch_reason = _unmodelled_architecture(architecture, outer_type, model_type)
    quant, quant_reason = _quantisation(doc)
    tower, vision_reason = _vision_figures(outer_type, vision, doc, hidden)
    vision_params, vision_whole, vision_heads = tower
    window = doc.get("sliding_window")
    dtype = doc.get("torch_dtype") or doc.get("dtype")
    qkv_bias = doc.get("attention_bias", model_type in ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"))
    return ModelShape(
        name=model_name,
        vocab_size=_int(doc, "vocab_size", model_name),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate,
        # transformers' own default when the key is absent: Gemma ties, the others here do not
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", model_type.startswith("gemma"))),
        head_dim=head_dim,
        qkv_bias=bool(qkv_bias),
        max_position_embeddings=_max_position(doc),
        torch_dtype=str(dtype) if isinstance(dtype, str) else None,
        quant=quant,
        mla=mla,
        linear=linear,
        layer_kinds=kinds if any(k != "full" for k in kinds) else (),
        sliding_window=window if isinstance(window, int) and "sliding" in kinds else 0,
        attention_chunk_size=_opt_int(doc, "attention_chunk_size", model_name) if "chunked" in kinds else 0,
        vision_params=vision_params,
        vision_replicated_params=vision_whole,
        vision_heads=vision_heads,
        architecture=architecture,
        # the first reason wins: the family, then the quantisation, then the vision tower
        unmodelled=arch_reason or quant_reason or vision_reason,
        **moe,
    )
