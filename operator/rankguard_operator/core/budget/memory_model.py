"""The memory of one vLLM rank, piece by piece: the defaults rankguard renders, the priors
used where nothing was measured (each with its source), and the building blocks the planner
adds up (weights via `weights`, logits, sampler, activations, context/NCCL; the KV cache is
`kv_model`'s). Sources: shared/reference/rank0-oom-article.txt ("the article") and
shared/reference/vllm-memory-facts.md ("the facts").

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.model.quantization import UnknownQuantization, runtime_scheme, uniform_scheme
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.model.weights import rank_weight_bytes
from rankguard_operator.core.spec.crd import LogitsMode
from rankguard_operator.core.units import GiB, MiB

# --------------------------------------------------------------------------------------------
# Defaults. The KV facts come from the recorded vLLM snapshot (engine.json), not from memory.

# vLLM's block size when --block-size is not given (CacheConfig.DEFAULT_BLOCK_SIZE) differs by
# release (16 up to 0.33, 64 from 0.34): the budget reads the engine's own release
# (kv_model.default_block_size; bounds.engine_block_size from the image's tag). This is only the
# fallback of a PlanInput built with no engine in mind (tests, bench): the fallback release's
# (vllm_snapshots.ESTIMATE_SIZING_RELEASE). rankguard renders --block-size only when the spec sets
# it, so vLLM's own choice stands otherwise.
DEFAULT_BLOCK_SIZE = vllm_snapshots.load(vllm_snapshots.ESTIMATE_SIZING_RELEASE).default_block_size

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
# CUDA-graph pool, which vLLM 0.33 estimates and subtracts before sizing the KV cache
# (gpu_worker.determine_available_memory, "CUDA graph pool memory (estimated)"); `--enforce-eager`
# skips capture. It grows with the graphs captured: one per capture size and layer (piecewise
# graphs split at every attention; a FULL graph holds every layer's kernels). Per size and layer:
# log qwen2-7b-tp1-a100-80gb-util0.5-vllm0.10.1.1 ("Graph capturing finished ..., took 0.50 GiB",
# 28 layers x vLLM 0.10's 67 capture sizes). vLLM 0.33 captures FULL decode graphs as well
# (FULL_AND_PIECEWISE), so on the same model it plans more than 0.10 took: the side of safety.
CUDAGRAPH_BYTES_PER_SIZE_LAYER = round(0.50 * GiB / (67 * 28))
# Under TP the graphs hold the all-reduce's NCCL work too: 0.65 GiB at TP2 on one node where TP1
# took 0.50 (log qwen2-7b-tp2-a100-80gb-util0.25-vllm0.10.1.1, custom all-reduce off), and 1.00
# GiB when the TP group spans two nodes (log qwen2-7b-tp2-a100-40gb-2nodes-util0.5-vllm0.10.1.1).
CUDAGRAPH_TP_FACTOR = 1.3
CUDAGRAPH_CROSS_NODE_FACTOR = 2.0
# vLLM 0.33's default capture ceiling (config/vllm.py: 512, 1024 on Blackwell; rankguard takes
# the 512 of the cards it plans for).
CUDAGRAPH_MAX_CAPTURE_SIZE = 512
# NCCL memory allocated lazily by the profile run's first all-reduces, after vLLM's start-up
# snapshot, so vLLM counts it in its non-KV memory (unlike the communicator's init, in the
# context prior). One node: Qwen2-7B's non-KV beyond weights and graphs was 0.66 GiB at TP2 vs
# 0.53-0.55 at TP1 (logs qwen2-7b-tp2-a100-80gb-util0.25/0.5 and qwen2-7b-tp1-a100-80gb-util0.25/0.5,
# vLLM 0.10.1.1, same model, same batch), ~0.12 GiB, taken at 0.15. Across nodes (NCCL's network
# transport): 1.54 GiB (log qwen2-7b-tp2-a100-40gb-2nodes-util0.5-vllm0.10.1.1, "Custom allreduce
# is disabled because this process group spans across nodes"), 1.0 GiB more than TP1.
PROFILE_NCCL_PRIOR_BYTES = round(0.15 * GiB)
PROFILE_NCCL_CROSS_NODE_PRIOR_BYTES = round(1.0 * GiB)
# Forward-pass activations: the analytic working set (below) times this factor for the
# caching allocator's rounding and the temporaries it ignores (rotary, norm outputs,
# all-reduce staging). A rankguard prior; the profile run's measured peak replaces it. 1.15:
# log llama31-8b-tp1-rtx3090-maxlen20k-v0 profiled a 20,000-token prompt at 2.07 GiB of torch
# peak (peak_torch_memory 17.06 - 14.99 weights) where the analytic set is 1.91 GiB (x 1.08).
# It was 1.4 (and 2 before), when the sampler's peak was taken as adding to it; it does not
# (`runtime_peak_bytes`).
ACTIVATION_OVERHEAD_FACTOR = 1.15
# The sampler on a rank that holds full-vocab logits: "the sampler converts them to float32"
# and profile_run includes "a dummy sampler run over max_num_seqs rows" (the facts). Beyond
# the fp32 logits themselves, three more fp32 vocab x batch working copies (temperature,
# softmax probabilities, the sorted copy top-p/top-k need): with the logits 16 bytes a value,
# 0.58 GiB for Qwen2-7B at 256 sequences, where vLLM 0.10 measured 0.53-0.55 GiB beyond the
# weights, all of its non-KV memory at TP1 with its graphs apart (logs qwen2-7b-tp1-*).
SAMPLER_FP32_COPIES = 3
# The least non-torch memory a vLLM process was seen to hold: "non_torch_memory=0.35GiB" (log
# llama31-8b-tp1-rtx3090-maxlen20k-v0). The feasibility verdict's lower bound, never a budget.
CONTEXT_FLOOR_BYTES = round(0.35 * GiB)
LOGITS_BYTES_PER_VALUE = 4  # the article's table is "float32 logits"

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


def weight_bytes(
    shape: ModelShape,
    tp: int,
    *,
    pp_stage: int = 0,
    pp: int = 1,
    layers: int | None = None,
    first_layer: int | None = None,
    dtype: str = "auto",
    weight_dtype: str = "auto",
    quantization: str | None = None,
) -> int:
    """Weight bytes one rank of `pp_stage` holds (module by module: `weights`). `layers` is the
    stage's layer count (all layers by default), `first_layer` its first layer (default: as
    vLLM's own split places it). `weight_dtype` other than auto sizes every Linear layer at
    that width; `quantization` is vLLM's runtime --quantization on an unquantised checkpoint;
    otherwise the checkpoint's own quantisation (config.json) applies."""
    check_tp(shape, tp)
    n_layers = shape.num_layers if layers is None else layers
    if first_layer is None:
        first_layer = sum(pp_layer_partition(shape.num_layers, pp)[:pp_stage]) if layers is not None else 0
    quant = shape.quant
    if quantization is not None and quant is None:
        try:
            quant = runtime_scheme(quantization)
        except UnknownQuantization as exc:
            raise PlanError(str(exc)) from None
    if weight_dtype.lower() != "auto":
        quant = uniform_scheme(weight_bits(shape, weight_dtype, dtype))
    elif quant is None and shape.quant_bits is not None:
        quant = uniform_scheme(shape.quant_bits)
    return rank_weight_bytes(
        shape,
        tp,
        range(first_layer, first_layer + n_layers),
        first_stage=pp_stage == 0,
        last_stage=pp_stage == pp - 1,
        pp=pp,
        act=act_bytes(dtype),
        quant=quant,
    )


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
    residual + hidden states, plus the largest phase of any layer kind: attention (q, k, v and
    the output; MLA's latent and its per-head expansion; a linear-attention layer's projections)
    or the MLP (gate_up and activation output; for MoE, for each routed token copy plus the
    shared expert), times ACTIVATION_OVERHEAD_FACTOR."""
    check_tp(shape, tp)
    b = act_bytes(dtype)
    h, d = shape.hidden_size, shape.head_dim
    q_heads = -(-shape.num_heads // tp)
    kv_heads = shape.kv_heads_per_rank(tp)
    phases = [(q_heads + 2 * kv_heads) * d + q_heads * d]
    if shape.mla is not None:
        m = shape.mla
        qd = m.qk_nope_head_dim + m.qk_rope_head_dim
        phases.append(m.q_lora_rank + m.latent_dim + q_heads * (qd + m.qk_nope_head_dim + 2 * m.v_head_dim))
    if shape.linear is not None:
        lin = shape.linear
        phases.append(-(-(2 * lin.conv_dim + lin.value_dim) // tp))
    phases.append(3 * -(-shape.dense_width() // tp))
    if shape.is_moe:
        inter = -(-shape.intermediate_size // tp)
        shared = -(-shape.shared_expert_intermediate_size // tp)
        phases.append(shape.experts_per_token * (3 * inter + h) + 3 * shared)
    return math.ceil(tokens * b * (2 * h + max(phases)) * ACTIVATION_OVERHEAD_FACTOR)


def runtime_peak_bytes(activation: int, logits: int, sampler: int) -> int:
    """The profile run's transient peak: vLLM frees the forward pass's working set before its
    dummy sampler run (profile_run: `_dummy_run`, then `_dummy_sampler_run` on the last hidden
    states), so the peak is the larger of the two phases, not their sum."""
    return max(activation, logits + sampler)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """How many graphs vLLM 0.33 captures by default (config/vllm.py, FULL_AND_PIECEWISE):
    piecewise sizes 1, 2, 4, 8..248 by 8, 256.. by 16 up to min(2 x max_num_seqs, 512,
    max_num_batched_tokens), plus max_num_batched_tokens when under that ceiling; and a FULL
    decode graph for each of those sizes up to max_num_seqs."""
    top = min(2 * max_num_seqs, CUDAGRAPH_MAX_CAPTURE_SIZE, max_num_batched_tokens)
    sizes = {i for i in (1, 2, 4) if i <= top} | set(range(8, min(top + 1, 256), 8))
    sizes |= set(range(256, top + 1, 16))
    if max_num_batched_tokens <= top:
        sizes.add(max_num_batched_tokens)
    return len(sizes) + sum(1 for s in sizes if s <= max_num_seqs)


def cudagraph_bytes(layers: int, tp: int, graphs: int, *, cross_node: bool = False) -> int:
    """The CUDA-graph pool prior of one rank holding `layers` layers (see the priors above)."""
    factor = 1.0 if tp == 1 else CUDAGRAPH_CROSS_NODE_FACTOR if cross_node else CUDAGRAPH_TP_FACTOR
    return math.ceil(CUDAGRAPH_BYTES_PER_SIZE_LAYER * graphs * layers * factor)


def profile_comm_bytes(tp: int, pp: int, *, cross_node: bool = False) -> int:
    """NCCL memory the profile run allocates after vLLM's snapshot (see the priors above)."""
    if tp * pp == 1:
        return 0
    return PROFILE_NCCL_CROSS_NODE_PRIOR_BYTES if cross_node else PROFILE_NCCL_PRIOR_BYTES


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


def lazy_comm_prior_bytes(rank: int, tp: int, pp: int) -> int:
    """The part of a pipeline-terminal rank's context+communication prior that NCCL creates with
    the first pipeline traffic, after the KV cache is allocated (the PP-terminal floor above the
    CUDA context, communicator and custom all-reduce priors); 0 on any other rank."""
    if pp == 1 or rank // tp != pp - 1:
        return 0
    at_init = CONTEXT_PRIOR_BYTES + NCCL_PRIOR_BYTES  # world = tp × pp > 1 here
    if tp in CUSTOM_ALLREDUCE_WORLD_SIZES:
        at_init += CUSTOM_ALLREDUCE_PRIOR_BYTES
    return max(0, PP_TERMINAL_COMM_PRIOR_BYTES - at_init)
