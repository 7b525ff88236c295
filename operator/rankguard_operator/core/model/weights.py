"""Weight bytes one rank holds, module by module, the way vLLM shards and quantises them.

Each decoder layer is listed as named modules (HF-style names such as
`model.layers.3.mlp.down_proj`, so a checkpoint's "keep these in 16-bit" list can be matched
against them) with the parameters ONE rank holds: column/row-parallel layers split by TP;
k/v of GQA keep max(1, kv_heads // tp) heads; MLA's down-projections (`q_a_proj`,
`kv_a_proj_with_mqa`, vLLM's fused_qkv_a_proj) and every norm and MoE router are replicated;
routed experts are split by TP (or by expert under expert parallelism: the same bytes per
rank). Quantisation applies to the Linear modules only; everything else is in the
activation dtype. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankguard_operator.core.model.quantization import QuantScheme
from rankguard_operator.core.model.shape import ModelShape

# VocabParallelEmbedding pads the vocabulary to a multiple of 64 before splitting it.
VOCAB_PADDING = 64


@dataclass(frozen=True)
class Module:
    name: str
    params: int  # on one rank
    linear: bool  # a quantisable Linear layer (norms, routers, biases and embeddings are not)


def _split(n: int, tp: int) -> int:
    return -(-n // tp)


def attention_modules(shape: ModelShape, i: int, tp: int) -> list[Module]:
    p = f"model.layers.{i}."
    h, d = shape.hidden_size, shape.head_dim
    lin = shape.linear
    if shape.layer_kind(i) == "linear" and lin is not None:
        a = p + "linear_attn."
        return [
            Module(a + "in_proj_qkvz", _split(h * (2 * lin.key_dim + 2 * lin.value_dim), tp), True),
            Module(a + "in_proj_ba", _split(h * 2 * lin.num_value_heads, tp), True),
            Module(a + "conv1d", _split(lin.conv_dim * lin.conv_kernel, tp), False),
            Module(a + "out_proj", _split(lin.value_dim * h, tp), True),
            Module(a + "A_log", _split(2 * lin.num_value_heads, tp), False),
            Module(a + "norm", lin.value_head_dim, False),
        ]
    a = p + "self_attn."
    if shape.mla is not None:
        m, heads = shape.mla, _split(shape.num_heads, tp)
        q_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        mods = [
            Module(a + "kv_a_proj_with_mqa", h * m.latent_dim, True),
            Module(a + "kv_a_layernorm", m.kv_lora_rank, False),
            Module(a + "kv_b_proj", m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim), True),
            Module(a + "o_proj", heads * m.v_head_dim * h, True),
        ]
        if m.q_lora_rank:
            mods += [
                Module(a + "q_a_proj", h * m.q_lora_rank, True),
                Module(a + "q_a_layernorm", m.q_lora_rank, False),
                Module(a + "q_b_proj", m.q_lora_rank * heads * q_dim, True),
            ]
        else:
            mods.append(Module(a + "q_proj", h * heads * q_dim, True))
        return mods
    q_heads = _split(shape.num_heads, tp)
    kv_heads = shape.kv_heads_per_rank(tp)
    mods = [
        Module(a + "q_proj", h * q_heads * d, True),
        Module(a + "k_proj", h * kv_heads * d, True),
        Module(a + "v_proj", h * kv_heads * d, True),
        Module(a + "o_proj", q_heads * d * h, True),
    ]
    if shape.qkv_bias:
        mods.append(Module(a + "qkv_bias", (q_heads + 2 * kv_heads) * d, False))
    return mods


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple else n


def mlp_modules(shape: ModelShape, i: int, tp: int) -> list[Module]:
    p = f"model.layers.{i}.mlp."
    h = shape.hidden_size
    if not shape.is_moe_layer(i):
        width = _split(shape.dense_width(), tp)
        return [Module(p + name, h * width, True) for name in ("gate_proj", "up_proj", "down_proj")]
    q = shape.quant
    inter = _round_up(_split(shape.intermediate_size, tp), q.expert_padding if q is not None else 0)
    padded_h = _round_up(h, q.expert_hidden_padding if q is not None else 0)
    mods = [
        Module(p + "experts", shape.num_experts * 3 * padded_h * inter, True),
        Module(p + "gate", h * shape.num_experts, False),  # the router: replicated, never quantised
    ]
    if shape.shared_expert_intermediate_size:
        mods.append(
            Module(p + "shared_experts", 3 * h * _split(shape.shared_expert_intermediate_size, tp), True)
        )
    return mods


def layer_modules(shape: ModelShape, i: int, tp: int) -> list[Module]:
    norms = Module(f"model.layers.{i}.input_layernorm", 2 * shape.hidden_size, False)
    return attention_modules(shape, i, tp) + mlp_modules(shape, i, tp) + [norms]


def module_bytes(mod: Module, act: int, quant: QuantScheme | None) -> int:
    if not mod.linear or quant is None or quant.bits_for(mod.name) is None:
        return mod.params * act
    return quant.linear_bytes(mod.params)


def vocab_per_rank(shape: ModelShape, tp: int) -> int:
    padded = -(-shape.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def rank_weight_bytes(
    shape: ModelShape,
    tp: int,
    layer_range: range,
    *,
    first_stage: bool,
    last_stage: bool,
    pp: int,
    act: int,
    quant: QuantScheme | None,
) -> int:
    """Weight bytes of one rank holding `layer_range` (its pipeline stage's layers). The first
    stage holds the embedding and the vision tower (whole on every rank: see
    ModelShape.vision_params_per_rank), the last the final norm and the LM head (under PP a
    tied head is a second copy there)."""
    per_layer: dict[tuple[object, ...], int] = {}
    total = 0
    for i in layer_range:
        # layers of the same kind cost the same: compute each kind once (126 layers x modules)
        key = (shape.layer_kind(i), shape.is_moe_layer(i), quant is not None and quant.ignore and i)
        if key not in per_layer:
            per_layer[key] = sum(module_bytes(m, act, quant) for m in layer_modules(shape, i, tp))
        total += per_layer[key]
    rows = vocab_per_rank(shape, tp)
    if first_stage:
        total += rows * shape.hidden_size * act + shape.vision_params_per_rank(tp) * act
    if last_stage:
        total += shape.hidden_size * act
        if not shape.tie_word_embeddings or pp > 1:
            total += rows * shape.hidden_size * act
    return total
