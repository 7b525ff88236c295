"""What a model is made of, as far as GPU memory is concerned: `ModelShape` and its parts.

A shape describes a decoder-only language model layer by layer: which attention each layer
has (full, sliding-window, chunked-local, MLA's compressed latent, or a linear-attention
state), whether its MLP is dense or a mixture of experts (routed and shared), plus the
embeddings, a vision tower's parameter count for multimodal checkpoints, and the checkpoint's
quantisation. Everything the memory model needs, nothing else. Pure: no I/O.

`unmodelled` is the honest escape hatch: a shape the planner must not plan from priors (an
architecture or feature it does not know) carries the reason, and the service goes
measure-first instead of being planned silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rankguard_operator.core.model.quantization import QuantScheme

LayerKind = Literal["full", "sliding", "chunked", "linear"]
LAYER_KINDS: tuple[LayerKind, ...] = ("full", "sliding", "chunked", "linear")


class ModelError(ValueError):
    """Base class: the model cannot be turned into a usable shape."""


class UnknownModelError(ModelError):
    """The model is not in the catalog and no (complete) shape was given. The message says what to provide."""


class InvalidShapeError(ModelError):
    """A shape (override, config.json, or dataclass arguments) is incomplete or impossible."""


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): K and V are cached as ONE
    compressed latent of kv_lora_rank + qk_rope_head_dim values per token and layer, the same
    on every TP rank (vLLM's MLAAttentionSpec has one KV head, never split)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries are not compressed (DeepSeek-V2-Lite)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttention:
    """A gated delta-net linear-attention layer (Qwen3-Next): a fixed-size state per SEQUENCE
    (a short convolution window plus the recurrent key x value state), not per token."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelShape:
    """Architecture figures of a decoder-only transformer.

    `head_dim` 0 means "hidden_size // num_heads" and is filled in on construction. For MoE
    models `intermediate_size` is ONE routed expert's MLP width; the dense layers of a MoE
    model (DeepSeek's first_k_dense_replace, Llama 4's interleaving) use
    `dense_intermediate_size`. `layer_kinds` lists each layer's attention (empty: all full);
    `moe_layers` which layers are MoE (empty: all of them when num_experts > 0).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0
    num_experts: int = 0  # routed experts per MoE layer; 0 = dense MLP
    experts_per_token: int = 0
    shared_expert_intermediate_size: int = 0  # always-on expert(s), total width; 0 = none
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v; a rounding error for memory, kept for honesty
    max_position_embeddings: int | None = None  # vLLM's default max_model_len
    torch_dtype: str | None = None  # checkpoint dtype from config.json
    quant_bits: int | None = None  # uniform weight bits of the blocks' linear layers (a plain override)
    quant: QuantScheme | None = None  # the checkpoint's quantisation, module by module
    mla: MLA | None = None
    linear: LinearAttention | None = None
    layer_kinds: tuple[LayerKind, ...] = ()
    sliding_window: int = 0
    attention_chunk_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    dense_intermediate_size: int = 0
    vision_params: int = 0  # a multimodal checkpoint's vision tower + projector, all ranks' share
    # the part of vision_params vLLM keeps whole on every TP rank (None: all of it, the safe count)
    vision_replicated_params: int | None = None
    vision_heads: int = 0  # the tower's attention heads: a TP size that does not divide them replicates it
    architecture: str = ""  # config.json's architectures[0] (or model_type)
    unmodelled: str = ""  # why this shape must not be planned from priors; "" = modelled

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
        ):
            _require_positive_int(f, getattr(self, f), self.name)
        for f in (
            "head_dim",
            "num_experts",
            "experts_per_token",
            "shared_expert_intermediate_size",
            "sliding_window",
            "attention_chunk_size",
            "dense_intermediate_size",
            "vision_params",
            "vision_heads",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidShapeError(f"model {self.name!r}: {f} must be a non-negative integer, got {v!r}")
        if self.max_position_embeddings is not None:
            _require_positive_int("max_position_embeddings", self.max_position_embeddings, self.name)
        if self.quant_bits is not None and self.quant_bits not in (2, 3, 4, 8, 16):
            raise InvalidShapeError(
                f"model {self.name!r}: quant_bits must be 2, 3, 4, 8 or 16, got {self.quant_bits!r}"
            )
        if self.num_kv_heads > self.num_heads:
            raise InvalidShapeError(
                f"model {self.name!r}: num_kv_heads ({self.num_kv_heads}) exceeds num_heads "
                f"({self.num_heads}); a KV head serves one or more query heads"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidShapeError(
                f"model {self.name!r}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}); grouped-query attention shares each KV head among whole query heads"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads != 0:
                raise InvalidShapeError(
                    f"model {self.name!r}: hidden_size ({self.hidden_size}) is not a multiple of num_heads "
                    f"({self.num_heads}); give head_dim (headDim) explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if (self.num_experts == 0) != (self.experts_per_token == 0):
            raise InvalidShapeError(
                f"model {self.name!r}: num_experts ({self.num_experts}) and experts_per_token "
                f"({self.experts_per_token}) must both be set for a MoE model, or both be 0"
            )
        if self.experts_per_token > self.num_experts:
            raise InvalidShapeError(
                f"model {self.name!r}: experts_per_token ({self.experts_per_token}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        for f in ("layer_kinds", "moe_layers"):
            seq = getattr(self, f)
            if seq and len(seq) != self.num_layers:
                raise InvalidShapeError(
                    f"model {self.name!r}: {f} lists {len(seq)} layers but the model has {self.num_layers}"
                )
        for kind in self.layer_kinds:
            if kind not in LAYER_KINDS:
                raise InvalidShapeError(
                    f"model {self.name!r}: layer kind {kind!r} is not one of {LAYER_KINDS}"
                )
        if "sliding" in self.layer_kinds and self.sliding_window <= 0:
            raise InvalidShapeError(f"model {self.name!r}: sliding-window layers need sliding_window > 0")
        if "chunked" in self.layer_kinds and self.attention_chunk_size <= 0:
            raise InvalidShapeError(f"model {self.name!r}: chunked layers need attention_chunk_size > 0")
        if "linear" in self.layer_kinds and self.linear is None:
            raise InvalidShapeError(f"model {self.name!r}: linear-attention layers need their head sizes")

    # ------------------------------------------------------------------ layer by layer

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_kind(self, layer: int) -> LayerKind:
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    def is_moe_layer(self, layer: int) -> bool:
        if not self.is_moe:
            return False
        return self.moe_layers[layer] if self.moe_layers else True

    def dense_width(self) -> int:
        """The MLP width of a dense layer (a MoE model's dense layers have their own)."""
        return self.dense_intermediate_size or self.intermediate_size

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each TP rank stores. With fewer KV heads than ranks vLLM replicates them:
        max(1, kv_heads // tp) (vllm-memory-facts.md, "KV bytes")."""
        return max(1, self.num_kv_heads // tp)

    def vision_params_per_rank(self, tp: int, *, encoder_tp: bool = False) -> int:
        """The vision tower's parameters on one TP rank. vLLM 0.33's default
        (--mm-encoder-tp-mode weights, `encoder_tp`) splits the tower's blocks and keeps
        `vision_replicated_params` whole; "data" (which vLLM's own Qwen3-VL/Kimi-VL recipes
        pass) keeps all of it on every rank. The planner does not see that flag, so the
        default counts the whole tower on every rank (safe); so does a family whose split is
        unknown, or a TP size that does not divide the tower's heads (vLLM then runs it
        data-parallel: vision.py is_vit_use_data_parallel)."""
        whole = self.vision_replicated_params
        if not encoder_tp or whole is None or (tp > 1 and self.vision_heads and self.vision_heads % tp):
            return self.vision_params
        whole = min(whole, self.vision_params)
        return whole + -(-(self.vision_params - whole) // tp)

    def attention_params(self, layer: int) -> int:
        """Parameters of one layer's attention (or linear-attention mixer) at TP 1."""
        h, d = self.hidden_size, self.head_dim
        if self.layer_kind(layer) == "linear" and self.linear is not None:
            lin = self.linear
            in_proj = h * (2 * lin.key_dim + 2 * lin.value_dim) + h * 2 * lin.num_value_heads
            conv = lin.conv_dim * lin.conv_kernel
            return in_proj + conv + lin.value_dim * h + 2 * lin.num_value_heads + lin.value_head_dim
        if self.mla is not None:
            m, heads = self.mla, self.num_heads
            q_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = (
                (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * q_dim)
                if m.q_lora_rank
                else h * heads * q_dim
            )
            kv = (
                h * m.latent_dim
                + m.kv_lora_rank
                + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            )
            return q + kv + heads * m.v_head_dim * h
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        if self.qkv_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        return attn

    def mlp_params(self, layer: int) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.dense_width()  # gated MLP: gate, up, down
        experts = self.num_experts * 3 * h * self.intermediate_size
        router = h * self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size
        return experts + router + shared

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of one transformer block at TP 1 (attention + MLP/experts + 2 norms)."""
        return self.attention_params(layer) + self.mlp_params(layer) + 2 * self.hidden_size

    def num_params(self) -> int:
        """Total parameters at TP 1 (for sanity checks against published sizes)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        layers = sum(self.layer_params(i) for i in range(self.num_layers))
        return embed + head + layers + self.hidden_size + self.vision_params

    def describe(self) -> dict[str, Any]:
        """The figures a person checks a shape by (status, `rankguard plan`)."""
        kinds = {k: self.layer_kinds.count(k) for k in LAYER_KINDS if k in self.layer_kinds}
        out: dict[str, Any] = {
            "architecture": self.architecture or "unknown",
            "layers": self.num_layers,
            "attention": "mla" if self.mla is not None else "gqa",
            "params": self.num_params(),
        }
        if kinds:
            out["layerKinds"] = kinds
        if self.is_moe:
            out["experts"] = f"{self.experts_per_token}/{self.num_experts}"
        if self.quant is not None:
            out["quantization"] = self.quant.describe()
        if self.vision_params:
            out["visionParams"] = self.vision_params
        return out


def _require_positive_int(field_name: str, v: Any, model: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidShapeError(f"model {model!r}: {field_name} must be a positive integer, got {v!r}")
