"""Model shapes: the few numbers of a transformer that decide where GPU memory goes.

Three ways to get a `ModelShape`, in the order `resolve_model` prefers them:

1. an explicit override (the CRD's `spec.model.shape`, camelCase keys, or `rankguard plan
   --shape KEY=VALUE`), complete on its own or layered on top of 2/3;
2. a Hugging Face `config.json` (`shape_from_hf_config`; in a cluster without internet it
   comes from the ConfigMap named in `spec.model.configMap`, on the CLI from `--config`);
3. the built-in catalog, matched case-insensitively on the last path part of the model name
   (`meta-llama/Llama-3.1-70B-Instruct` -> `llama-3.1-70b`).

Catalog figures are the published `config.json` values of each model; the ones also listed in
`shared/reference/vllm-memory-facts.md` (Llama-3-8B/70B, Llama-3.1-405B, Mixtral-8x7B) match
that table. Pure: no I/O (reading the file or ConfigMap is the caller's job).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any


class ModelError(ValueError):
    """Base class: the model cannot be turned into a usable shape."""


class UnknownModelError(ModelError):
    """The model is not in the catalog and no (complete) shape was given. The message says what to provide."""


class InvalidShapeError(ModelError):
    """A shape (override, config.json, or dataclass arguments) is incomplete or impossible."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture figures of a decoder-only transformer (Llama-style, optionally Mixtral-style MoE).

    `head_dim` 0 means "hidden_size // num_heads" and is filled in on construction.
    For MoE models `intermediate_size` is the size of ONE expert's MLP.
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
    num_experts: int = 0  # routed experts per layer; 0 = dense MLP
    experts_per_token: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen-MoE style always-on expert; 0 = none
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v; a rounding error for memory, kept for honesty
    max_position_embeddings: int | None = None  # vLLM's default max_model_len
    torch_dtype: str | None = None  # checkpoint dtype from config.json
    quant_bits: int | None = None  # weight bits of the transformer blocks' linear layers if quantized

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
        for f in ("head_dim", "num_experts", "experts_per_token", "shared_expert_intermediate_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidShapeError(f"model {self.name!r}: {f} must be a non-negative integer, got {v!r}")
        if self.max_position_embeddings is not None:
            _require_positive_int("max_position_embeddings", self.max_position_embeddings, self.name)
        if self.quant_bits is not None and self.quant_bits not in (2, 3, 4, 8, 16):
            raise InvalidShapeError(
                f"model {self.name!r}: quant_bits must be 2, 3, 4, 8 or 16, got {self.quant_bits!r}"
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each TP rank stores. With fewer KV heads than ranks vLLM replicates them:
        max(1, kv_heads // tp) (vllm-memory-facts.md, "KV bytes")."""
        return max(1, self.num_kv_heads // tp)

    def layer_params(self) -> int:
        """Parameters of one transformer block at TP 1 (attention + MLP/experts + 2 norms)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        if self.qkv_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        return attn + self._mlp_params() + 2 * h

    def _mlp_params(self) -> int:
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size  # gated MLP: gate, up, down
        experts = self.num_experts * 3 * h * self.intermediate_size
        router = h * self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size
        return experts + router + shared

    def num_params(self) -> int:
        """Total parameters at TP 1 (for sanity checks against published sizes)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_layers * self.layer_params() + self.hidden_size


def _require_positive_int(field_name: str, v: Any, model: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidShapeError(f"model {model!r}: {field_name} must be a positive integer, got {v!r}")


# ---------------------------------------------------------------------------------------------
# Built-in catalog (published config.json figures)


def _llama3_8b(name: str, max_pos: int) -> ModelShape:
    return ModelShape(
        name=name,
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        max_position_embeddings=max_pos,
        torch_dtype="bfloat16",
    )


def _llama3_70b(name: str, max_pos: int) -> ModelShape:
    return ModelShape(
        name=name,
        vocab_size=128256,
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        intermediate_size=28672,
        max_position_embeddings=max_pos,
        torch_dtype="bfloat16",
    )


CATALOG: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _llama3_8b("llama-3-8b", 8192),
        _llama3_8b("llama-3.1-8b", 131072),
        _llama3_70b("llama-3-70b", 8192),
        _llama3_70b("llama-3.1-70b", 131072),
        _llama3_70b("llama-3.3-70b", 131072),
        ModelShape(
            name="llama-3.1-405b",
            vocab_size=128256,
            hidden_size=16384,
            num_layers=126,
            num_heads=128,
            num_kv_heads=8,
            intermediate_size=53248,
            max_position_embeddings=131072,
            torch_dtype="bfloat16",
        ),
        ModelShape(
            name="qwen2.5-72b",
            vocab_size=152064,
            hidden_size=8192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            intermediate_size=29568,
            qkv_bias=True,
            max_position_embeddings=32768,
            torch_dtype="bfloat16",
        ),
        ModelShape(
            name="mixtral-8x7b",
            vocab_size=32000,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            intermediate_size=14336,
            num_experts=8,
            experts_per_token=2,
            max_position_embeddings=32768,
            torch_dtype="bfloat16",
        ),
    )
}

# Suffixes that name a fine-tune or a packaging of the same architecture. Quantization
# suffixes (-awq, -gptq, -fp8) are deliberately NOT stripped: the weights differ in size,
# so such a model must come with its config.json (which says how it is quantized).
_VARIANT_SUFFIX = re.compile(r"-(instruct|chat|hf|base|it|v\d+(\.\d+)*)$")


def catalog_key(name: str) -> str:
    """Normalise a model name for catalog lookup: last path part, lower case, vendor prefix and
    fine-tune suffixes removed (`meta-llama/Meta-Llama-3-70B-Instruct` -> `llama-3-70b`)."""
    key = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    key = key.removeprefix("meta-")
    key = re.sub(r"^llama(\d)", r"llama-\1", key)  # "llama3-70b" is a common spelling
    while True:
        stripped = _VARIANT_SUFFIX.sub("", key)
        if stripped == key:
            return key
        key = stripped


def lookup_catalog(name: str) -> ModelShape | None:
    return CATALOG.get(catalog_key(name))


# ---------------------------------------------------------------------------------------------
# Overrides (CRD spec.model.shape / CLI --shape): camelCase key -> ModelShape field

SHAPE_OVERRIDE_KEYS: dict[str, str] = {
    "vocabSize": "vocab_size",
    "hiddenSize": "hidden_size",
    "numLayers": "num_layers",
    "numHeads": "num_heads",
    "numKVHeads": "num_kv_heads",
    "intermediateSize": "intermediate_size",
    "tieWordEmbeddings": "tie_word_embeddings",
    "headDim": "head_dim",
    "numExperts": "num_experts",
    "expertsPerToken": "experts_per_token",
    "maxPositionEmbeddings": "max_position_embeddings",
}
# The keys a shape needs when there is nothing (catalog entry or config.json) to fill gaps from.
REQUIRED_OVERRIDE_KEYS: tuple[str, ...] = (
    "vocabSize",
    "hiddenSize",
    "numLayers",
    "numHeads",
    "numKVHeads",
    "intermediateSize",
)


def _what_to_provide() -> str:
    optional = [k for k in SHAPE_OVERRIDE_KEYS if k not in REQUIRED_OVERRIDE_KEYS]
    return (
        f"provide spec.model.shape with {', '.join(REQUIRED_OVERRIDE_KEYS)} "
        f"(optional: {', '.join(optional)}), or spec.model.configMap naming a ConfigMap that holds the "
        "model's config.json; on the command line use --config path/to/config.json or --shape KEY=VALUE"
    )


def resolve_model(
    name: str,
    override: Mapping[str, Any] | None = None,
    *,
    hf_config: Mapping[str, Any] | None = None,
) -> ModelShape:
    """The shape to plan with for `name`.

    Precedence: `override` keys win over `hf_config`, which wins over the catalog. An override
    alone must be complete (`REQUIRED_OVERRIDE_KEYS`). Raises `UnknownModelError` (message
    says exactly what to provide) or `InvalidShapeError`.
    """
    base = shape_from_hf_config(hf_config, name=name) if hf_config is not None else lookup_catalog(name)
    if not override:
        if base is None:
            raise UnknownModelError(
                f"unknown model {name!r}: rankguard has no built-in shape for it "
                f"(built-in: {', '.join(sorted(CATALOG))}); {_what_to_provide()}"
            )
        return replace(base, name=name) if base.name != name else base
    unknown = sorted(set(override) - set(SHAPE_OVERRIDE_KEYS))
    if unknown:
        raise InvalidShapeError(
            f"model {name!r}: unknown shape field(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(SHAPE_OVERRIDE_KEYS)}"
        )
    values = {SHAPE_OVERRIDE_KEYS[k]: v for k, v in override.items() if v is not None}
    if base is None:
        missing = [k for k in REQUIRED_OVERRIDE_KEYS if SHAPE_OVERRIDE_KEYS[k] not in values]
        if missing:
            raise UnknownModelError(
                f"unknown model {name!r} and the shape given is incomplete: missing {', '.join(missing)}; "
                f"{_what_to_provide()}"
            )
        if "head_dim" not in values:
            values["head_dim"] = 0
        return ModelShape(name=name, **values)
    # head_dim of the base was derived from its hidden/heads; re-derive when those change
    if "head_dim" not in values and ("hidden_size" in values or "num_heads" in values):
        values["head_dim"] = 0
    return replace(base, name=name, **values)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def _cfg_int(doc: Mapping[str, Any], key: str, name: str, default: int | None = None) -> int:
    v = doc.get(key, default)
    if v is None:
        raise InvalidShapeError(
            f"config.json for {name!r} lacks {key!r}; it is needed to size weights and KV cache "
            f"(or give spec.model.shape / --shape instead)"
        )
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidShapeError(f"config.json for {name!r}: {key} must be a positive integer, got {v!r}")
    return v


def _quant_bits(doc: Mapping[str, Any]) -> int | None:
    q = doc.get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method.startswith("fp8") or method in ("fbgemm_fp8", "modelopt"):
        return 8
    for key in ("bits", "w_bit", "weight_bits"):
        b = q.get(key)
        if isinstance(b, int) and not isinstance(b, bool) and b in (2, 3, 4, 8):
            return b
    # A quantization scheme we do not understand: plan with the unquantized size, which
    # over-counts weights and so under-sizes (never over-sizes) the KV budget.
    return None


def shape_from_hf_config(doc: Mapping[str, Any], name: str | None = None) -> ModelShape:
    """Build a shape from a Hugging Face `config.json` document (already parsed).

    Handles dense Llama/Qwen/Mistral-style configs, Mixtral-style MoE (`num_local_experts`,
    `num_experts_per_tok`) and Qwen-MoE-style (`num_experts`, `moe_intermediate_size`,
    `shared_expert_intermediate_size`). Multimodal configs are read from their `text_config`.
    A missing `tie_word_embeddings` counts as untied: that over-counts weights (a safe error).
    """
    if not isinstance(doc, Mapping):
        raise InvalidShapeError(f"config.json must be a JSON object, got {type(doc).__name__}")
    model_name = name or str(doc.get("_name_or_path") or doc.get("model_type") or "config.json")
    text = doc.get("text_config")
    if "hidden_size" not in doc and isinstance(text, Mapping):
        doc = {**text, "tie_word_embeddings": doc.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
    heads = _cfg_int(doc, "num_attention_heads", model_name)
    num_experts = doc.get("num_local_experts") or doc.get("num_experts") or 0
    experts_per_token = (doc.get("num_experts_per_tok") or 0) if num_experts else 0
    if num_experts and doc.get("moe_intermediate_size"):
        intermediate = _cfg_int(doc, "moe_intermediate_size", model_name)
    else:
        intermediate = _cfg_int(doc, "intermediate_size", model_name)
    head_dim = doc.get("head_dim") or 0
    dtype = doc.get("torch_dtype") or doc.get("dtype")
    model_type = str(doc.get("model_type", "")).lower()
    qkv_bias = bool(doc.get("attention_bias", model_type in ("qwen2", "qwen2_moe")))
    max_pos = doc.get("max_position_embeddings")
    if isinstance(max_pos, bool) or not isinstance(max_pos, int):
        max_pos = None
    shared = (doc.get("shared_expert_intermediate_size") or 0) if num_experts else 0
    return ModelShape(
        name=model_name,
        vocab_size=_cfg_int(doc, "vocab_size", model_name),
        hidden_size=_cfg_int(doc, "hidden_size", model_name),
        num_layers=_cfg_int(doc, "num_hidden_layers", model_name),
        num_heads=heads,
        num_kv_heads=_cfg_int(doc, "num_key_value_heads", model_name, default=heads),
        intermediate_size=intermediate,
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)),
        head_dim=head_dim,
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        shared_expert_intermediate_size=shared,
        qkv_bias=qkv_bias,
        max_position_embeddings=max_pos,
        torch_dtype=str(dtype) if isinstance(dtype, str) else None,
        quant_bits=_quant_bits(doc),
    )
