"""The memory of one vLLM rank, piece by piece: the defaults rankguard renders, the priors
used where nothing was measured (each with its source), and the building blocks the planner
adds up (weights, logits, sampler, activations, context/NCCL, KV per token and per request,
capacity for a budget). Sources: shared/reference/rank0-oom-article.txt ("the article") and
shared/reference/vllm-memory-facts.md ("the facts").

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.models import ModelShape
from rankguard_operator.core.units import GiB, MiB

LogitsMode = Literal["gather", "all-gather"]
LOGITS_MODES: tuple[str, ...] = ("gather", "all-gather")

# --------------------------------------------------------------------------------------------
# Defaults. The KV facts come from the recorded vLLM snapshot (engine.json), not from memory.

# vLLM's block size when --block-size is not given (CacheConfig.DEFAULT_BLOCK_SIZE); rankguard
# renders --block-size only when the spec sets it, so vLLM's own choice stands otherwise.
DEFAULT_BLOCK_SIZE = vllm_snapshots.latest().default_block_size
# Blocks the block pool holds back for good (vLLM >= 0.33's "null block", reserved before the
# too-small check): a budget must hold one request's blocks PLUS these, or vLLM refuses to start.
NULL_BLOCKS = vllm_snapshots.latest().null_blocks
DEFAULT_MAX_NUM_SEQS = 256  # the facts: vLLM's default is 256 or 1024 by GPU size; we pass it explicitly
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1's chunked-prefill default for online serving
DEFAULT_SAFETY_MARGIN_BYTES = 512 * MiB  # rankguard's default; room for transients the priors miss

# --------------------------------------------------------------------------------------------
# Priors: used only where a rank has no measurement. Each says where its figure comes from.

# CUDA context + other non-torch memory of one process with no NCCL: "non-torch memory 1.79
# GiB at TP1 (Llama-3-8B, PR #10511)" (the facts, "NCCL and friends").
CONTEXT_PRIOR_BYTES = round(1.79 * GiB)
# NCCL communicator memory once world size > 1: "~4.5 GiB NCCL under TP (PR #25359)" (the
# facts). Ring buffers are per neighbour (NCCL_BUFFSIZE 4 MiB per channel/peer), so the prior
# does not grow with TP; it is taken at the larger reported figure, since vLLM's default
# 0.92 utilisation leaves a similar ~6.4 GiB of an 80 GiB card outside the budget.
NCCL_PRIOR_BYTES = round(4.5 * GiB)
# vLLM custom all-reduce: "≈ 24 MiB/rank for world sizes 2/4/6/8" (the facts).
CUSTOM_ALLREDUCE_PRIOR_BYTES = 24 * MiB
CUSTOM_ALLREDUCE_WORLD_SIZES = (2, 4, 6, 8)
# Global rank 0 is NCCL's root and "allocates additional coordination buffers ... tens to
# hundreds of MB depending on the algorithm ... the direction is always toward rank 0" (the article).
RANK0_COMM_EXTRA_PRIOR_BYTES = 128 * MiB
# Pipeline-terminal ranks: "8.76 GiB on a PP-terminal rank vs 1–2 GiB on rank 0 (TP2×PP2,
# PR #45517)" (the facts). Used as the floor of that rank's context+communication prior.
PP_TERMINAL_COMM_PRIOR_BYTES = round(8.76 * GiB)
# CUDA-graph memory that vLLM (v1, default on) estimates and subtracts; `--enforce-eager` skips
# capture (the facts). No figure in the references: rankguard's conservative prior is 1 GiB
# (capture logs of dense 8B-70B models typically report well under that). Measure to replace it.
CUDAGRAPH_PRIOR_BYTES = 1 * GiB
# Forward-pass activations: the analytic working set (below) times this factor for the
# caching allocator's rounding and the temporaries it ignores (rotary, norm outputs,
# all-reduce staging). A rankguard prior; the profile run's measured peak replaces it.
ACTIVATION_OVERHEAD_FACTOR = 2
# The sampler on a rank that holds full-vocab logits: "the sampler converts them to float32"
# and profile_run includes "a dummy sampler run over max_num_seqs rows" (the facts). Beyond
# the fp32 logits themselves, rankguard assumes two more fp32 vocab x batch working copies
# (softmax probabilities and the sorted copy top-p/top-k need).
SAMPLER_FP32_COPIES = 2
LOGITS_BYTES_PER_VALUE = 4  # the article's table is "float32 logits"
# VocabParallelEmbedding pads the vocabulary to a multiple of 64 before splitting it.
VOCAB_PADDING = 64
# Group-quantised weights (AWQ/GPTQ, <= 4 bits) carry a 16-bit scale and zero point per group
# of 128 weights.
QUANT_GROUP_SIZE = 128

_ACT_DTYPE_BYTES = {
    "auto": 2,  # vLLM's "auto" serves fp32 checkpoints in 16-bit too
    "half": 2,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float": 4,
    "float32": 4,
    "fp32": 4,
}
_KV_DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
}
_WEIGHT_BITS = {
    "bfloat16": 16,
    "bf16": 16,
    "float16": 16,
    "fp16": 16,
    "half": 16,
    "float32": 32,
    "float": 32,
    "fp32": 32,
    "fp8": 8,
    "int8": 8,
    "int4": 4,
}


class PlanError(ValueError):
    """The inputs cannot describe a vLLM deployment. The message says which input and why."""


@dataclass(frozen=True)
class Capacity:
    blocks: int
    tokens: int
    max_concurrency: float


# --------------------------------------------------------------------------------------------
# Building blocks


def act_bytes(dtype: str) -> int:
    try:
        return _ACT_DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise PlanError(f"dtype {dtype!r} is not one of {', '.join(_ACT_DTYPE_BYTES)}") from None


def kv_dtype_bytes(kv_cache_dtype: str, dtype: str = "auto") -> int:
    """Bytes per KV element: fp8 variants 1, 16-bit 2; "auto" follows the model dtype."""
    key = kv_cache_dtype.lower()
    if key == "auto":
        return act_bytes(dtype)
    try:
        return _KV_DTYPE_BYTES[key]
    except KeyError:
        raise PlanError(
            f"kv cache dtype {kv_cache_dtype!r} is not one of auto, {', '.join(_KV_DTYPE_BYTES)}"
        ) from None


def weight_bits(shape: ModelShape, weight_dtype: str, dtype: str) -> int:
    key = weight_dtype.lower()
    if key == "auto":
        return shape.quant_bits if shape.quant_bits is not None else 8 * act_bytes(dtype)
    try:
        return _WEIGHT_BITS[key]
    except KeyError:
        raise PlanError(
            f"weight dtype {weight_dtype!r} is not one of auto, {', '.join(_WEIGHT_BITS)}"
        ) from None


def check_tp(shape: ModelShape, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tensor parallel size must be a positive integer, got {tp!r}")
    if shape.num_heads % tp != 0:
        raise PlanError(
            f"tensor parallel size {tp} does not divide the {shape.num_heads} attention heads of "
            f"{shape.name!r}; vLLM splits heads evenly across ranks"
        )
    kv = shape.num_kv_heads
    if (kv >= tp and kv % tp != 0) or (kv < tp and tp % kv != 0):
        raise PlanError(
            f"tensor parallel size {tp} and the {kv} KV heads of {shape.name!r} must divide one another "
            "(vLLM splits KV heads, or replicates them when there are fewer heads than ranks)"
        )


def pp_layer_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per pipeline stage as vLLM splits them by default: an even share each, and the
    remainder one extra layer for each stage counted backwards from the second-to-last (the
    last stage also runs the LM head, the first the embedding)."""
    if pp < 1 or pp > num_layers:
        raise PlanError(f"pipeline parallel size {pp} must be between 1 and the {num_layers} layers")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def kv_bytes_per_token(
    shape: ModelShape,
    tp: int = 1,
    kv_cache_dtype: str = "auto",
    *,
    dtype: str = "auto",
    layers: int | None = None,
) -> int:
    """KV bytes one token takes on ONE rank: 2 (K and V) × kv_heads_per_rank × head_dim ×
    kv dtype bytes × layers held by that rank (all layers unless `layers` says the PP stage's).
    kv_heads_per_rank = max(1, kv_heads // tp): replicated when kv_heads < tp (the facts)."""
    check_tp(shape, tp)
    n_layers = shape.num_layers if layers is None else layers
    return 2 * shape.kv_heads_per_rank(tp) * shape.head_dim * kv_dtype_bytes(kv_cache_dtype, dtype) * n_layers


def stage_layers(shape: ModelShape, pp: int, partition: Sequence[int] | None) -> tuple[int, ...]:
    if partition is None:
        return pp_layer_partition(shape.num_layers, pp)
    parts = tuple(partition)
    if len(parts) != pp or any(p < 1 for p in parts) or sum(parts) != shape.num_layers:
        raise PlanError(
            f"pp_layer_partition {list(parts)} must list {pp} positive layer counts that sum to "
            f"{shape.num_layers}"
        )
    return parts


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def min_budget_for_one_request(
    shape: ModelShape,
    tp: int,
    kv_cache_dtype: str = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int | None = None,
    *,
    pp: int = 1,
    dtype: str = "auto",
    pp_layer_partition: Sequence[int] | None = None,
) -> int:
    """The smallest --kv-cache-memory-bytes with which every rank still holds the blocks of one
    request at max_model_len plus the null block(s) the pool holds back (below it vLLM refuses
    to start with its kv_too_small message). The operator's shrink floor."""
    mml = resolve_max_model_len(shape, max_model_len)
    stages = stage_layers(shape, pp, pp_layer_partition)
    per_token = max(kv_bytes_per_token(shape, tp, kv_cache_dtype, dtype=dtype, layers=n) for n in stages)
    return (blocks_per_request(mml, block_size) + NULL_BLOCKS) * block_size * per_token


def capacity_for_budget(
    shape: ModelShape,
    tp: int,
    budget_bytes: int,
    *,
    kv_cache_dtype: str = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int | None = None,
    pp: int = 1,
    dtype: str = "auto",
    pp_layer_partition: Sequence[int] | None = None,
) -> Capacity:
    """Blocks, tokens and max concurrency at max_model_len that one per-GPU KV budget buys.

    blocks = budget // page bytes // layers per rank, minimum over ranks (the engine core takes
    the minimum, the facts); tokens = blocks × block_size (per replica, not × TP);
    concurrency = blocks / ceil(max_model_len / block_size), as vLLM prints it."""
    mml = resolve_max_model_len(shape, max_model_len)
    stages = stage_layers(shape, pp, pp_layer_partition)
    budget = max(0, budget_bytes)
    blocks = min(
        budget // (block_size * kv_bytes_per_token(shape, tp, kv_cache_dtype, dtype=dtype, layers=n))
        for n in stages
    )
    return Capacity(
        blocks=blocks,
        tokens=blocks * block_size,
        max_concurrency=blocks / blocks_per_request(mml, block_size),
    )


def resolve_max_model_len(shape: ModelShape, max_model_len: int | None) -> int:
    mml = max_model_len if max_model_len is not None else shape.max_position_embeddings
    if mml is None:
        raise PlanError(
            f"max_model_len is not given and the shape of {shape.name!r} has no max_position_embeddings; "
            "pass --max-model-len (spec.engine.maxModelLen)"
        )
    if isinstance(mml, bool) or not isinstance(mml, int) or mml < 1:
        raise PlanError(f"max_model_len must be a positive integer, got {mml!r}")
    return mml


def vocab_per_rank(shape: ModelShape, tp: int) -> int:
    padded = -(-shape.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def weight_bytes(
    shape: ModelShape,
    tp: int,
    *,
    pp_stage: int = 0,
    pp: int = 1,
    layers: int | None = None,
    dtype: str = "auto",
    weight_dtype: str = "auto",
) -> int:
    """Weight bytes one rank of `pp_stage` holds.

    Embedding (first stage) and untied LM head (last stage; under PP a tied head is a second
    copy there) are vocab-parallel, split by TP; attention q/o and the gated MLP (each expert's,
    for MoE) are split by TP; k/v keep max(1, kv_heads // tp) heads per rank; norms and the MoE
    router are replicated. Quantisation applies to the blocks' linear layers only.
    """
    check_tp(shape, tp)
    b = act_bytes(dtype)
    bits = weight_bits(shape, weight_dtype, dtype)
    n_layers = shape.num_layers if layers is None else layers
    h, d = shape.hidden_size, shape.head_dim
    q_heads = shape.num_heads // tp
    kv_heads = shape.kv_heads_per_rank(tp)
    inter = -(-shape.intermediate_size // tp)

    linear = h * q_heads * d * 2 + h * kv_heads * d * 2  # q, o; k, v
    if shape.is_moe:
        linear += shape.num_experts * 3 * h * inter
        linear += 3 * h * -(-shape.shared_expert_intermediate_size // tp)
    else:
        linear += 3 * h * inter
    linear_bytes = -(-linear * bits // 8)
    if bits <= 4:
        linear_bytes += -(-linear // QUANT_GROUP_SIZE) * 2 * 2  # 16-bit scale + zero per group
    replicated = 2 * h  # input and post-attention norms
    if shape.is_moe:
        replicated += h * shape.num_experts  # router
    if shape.qkv_bias:
        replicated += (q_heads + 2 * kv_heads) * d
    per_layer = linear_bytes + replicated * b

    total = n_layers * per_layer
    vocab_rows = vocab_per_rank(shape, tp)
    first, last = pp_stage == 0, pp_stage == pp - 1
    if first:
        total += vocab_rows * h * b
    if last:
        total += h * b  # final norm
        if not shape.tie_word_embeddings or pp > 1:
            total += vocab_rows * h * b
    return total


def logits_bytes(shape: ModelShape, tp: int, batch: int, mode: LogitsMode, *, tp_rank: int) -> int:
    """fp32 logits one rank of the LAST pipeline stage holds for `batch` sequences.

    gather (vLLM v0 / the article): tp_rank 0 gathers the full vocabulary, the others keep
    their vocab/tp shard; the extra on rank 0 is vocab × (1 − 1/tp) × batch × 4.
    all-gather (vLLM v1): every rank holds the full-vocab logits (the facts).
    """
    full = shape.vocab_size * batch * LOGITS_BYTES_PER_VALUE
    if mode == "all-gather" or tp_rank == 0:
        return full
    return -(-shape.vocab_size // tp) * batch * LOGITS_BYTES_PER_VALUE


def activation_bytes(shape: ModelShape, tp: int, tokens: int, dtype: str = "auto") -> int:
    """Forward-pass working set of one rank for the profile run's `tokens` (max_num_batched_tokens):
    residual + hidden states, plus the larger of the attention phase (qkv and attention output)
    and the MLP phase (gate_up and activation output; for MoE, for each routed token copy),
    times ACTIVATION_OVERHEAD_FACTOR."""
    check_tp(shape, tp)
    b = act_bytes(dtype)
    h, d = shape.hidden_size, shape.head_dim
    q_heads = shape.num_heads // tp
    kv_heads = shape.kv_heads_per_rank(tp)
    inter = -(-shape.intermediate_size // tp)
    attn = (q_heads + 2 * kv_heads) * d + q_heads * d
    if shape.is_moe:
        shared = -(-shape.shared_expert_intermediate_size // tp)
        mlp = shape.experts_per_token * (3 * inter + h) + 3 * shared
    else:
        mlp = 3 * inter
    return tokens * b * (2 * h + max(attn, mlp)) * ACTIVATION_OVERHEAD_FACTOR


def context_prior_bytes(rank: int, tp: int, pp: int) -> int:
    """CUDA context + NCCL + custom all-reduce prior for one rank (see the priors above)."""
    world = tp * pp
    prior = CONTEXT_PRIOR_BYTES
    if world > 1:
        prior += NCCL_PRIOR_BYTES
        if rank == 0:
            prior += RANK0_COMM_EXTRA_PRIOR_BYTES
    if tp in CUSTOM_ALLREDUCE_WORLD_SIZES:
        prior += CUSTOM_ALLREDUCE_PRIOR_BYTES
    if pp > 1 and rank // tp == pp - 1:
        prior = max(prior, PP_TERMINAL_COMM_PRIOR_BYTES)
    return prior
