"""The KV cache of one rank, as vLLM 0.33 builds it from a model's layers: what each layer puts
in the pool (`layer_kv`), the stage's layout (`stage_kv_layout`, grouped by `kv_layout` as the
hybrid allocator groups it), and from it the shrink floor (one request at max_model_len plus
the null block) and what a budget buys (blocks, tokens, max concurrency, as vLLM prints them).
The block size and the null blocks are the engine's release's (`default_block_size`: 16-token
blocks up to 0.33, 64 from 0.34).
Split from `memory_model` (the rest of a rank's memory) so each reads on its own.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.kv_layout import NULL_BLOCKS, KVLayout, LayerKV, kv_layout
from rankguard_operator.core.budget.memory_model import (
    DEFAULT_BLOCK_SIZE,
    Capacity,
    PlanError,
    check_tp,
    kv_dtype_bytes,
    pp_layer_partition,
)
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.spec.crd import DEFAULT_MAX_NUM_BATCHED_TOKENS

# MLA backends' kernel block (FlashMLA: get_supported_kernel_block_sizes [64]), which vLLM uses
# when --block-size is not given and the release's default is not a multiple of it.
MLA_BLOCK_SIZE = 64
# The CUDA attention backends vLLM picks first for standard attention (platforms/cuda.py
# _get_backend_priorities: FLASH_ATTN before FLASHINFER, FLASHINFER first on SM100): the block
# sizes they accept (the snapshot's surface.json `attention_block_sizes`) decide the default.
STANDARD_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
# vLLM's async scheduling keeps two steps in flight (VllmConfig.max_in_flight_tokens).
IN_FLIGHT_STEPS = 2
# A gated delta-net layer's state pages per request with prefix caching on (vLLM's default):
# 2 + 1 checkpoint page, and its block size aligned to 64 (kv_layout: MambaSpec, FlashInfer GDN).
MAMBA_PAGES_WITH_PREFIX_CACHING = 3
MAMBA_CHECKPOINT_ALIGNMENT = 64


def stage_range(stages: Sequence[int], stage: int) -> range:
    """The layer indices pipeline stage `stage` holds."""
    first = sum(stages[:stage])
    return range(first, first + stages[stage])


def layer_kv(shape: ModelShape, layer: int, tp: int, kv_bytes: int) -> LayerKV:
    """What one layer puts in vLLM's KV pool on one rank: K and V of its heads per token
    (max(1, kv_heads // tp) heads, replicated when fewer than ranks, the facts), MLA's one
    latent per token (not split by TP), or a linear-attention layer's state per sequence."""
    kind = shape.layer_kind(layer)
    lin = shape.linear
    if kind == "linear" and lin is not None:
        # gated delta-net state: the conv window (kernel - 1 columns of the conv channels) and
        # the recurrent value_head x key_head matrix per value head, split by TP
        conv = -(-lin.conv_dim // tp) * (lin.conv_kernel - 1)
        recurrent = -(-lin.num_value_heads // tp) * lin.key_head_dim * lin.value_head_dim
        return LayerKV("mamba", state_bytes=(conv + recurrent) * kv_bytes)
    if shape.mla is not None:
        return LayerKV("mla", bytes_per_token=shape.mla.latent_dim * kv_bytes)
    per_token = 2 * shape.kv_heads_per_rank(tp) * shape.head_dim * kv_bytes
    if kind == "sliding":
        return LayerKV("sliding", bytes_per_token=per_token, window=shape.sliding_window)
    if kind == "chunked":
        return LayerKV("chunked", bytes_per_token=per_token, window=shape.attention_chunk_size)
    return LayerKV("full", bytes_per_token=per_token)


def default_block_size(shape: ModelShape, release: vllm_snapshots.Snapshot | None = None) -> int:
    """The block size the engine of `release` uses when --block-size is not given, as vLLM
    resolves it (platforms/interface.py update_block_size_for_backend, 0.33 and 0.34 alike):
    its CacheConfig.DEFAULT_BLOCK_SIZE (engine.json `default_block_size`: 16 up to 0.33, 64 from
    0.34) when the attention backend supports it, else the smallest size the backend supports
    (AttentionBackend.get_preferred_block_size). Standard attention: FLASH_ATTN / FLASHINFER,
    which take both 16 and 64. MLA: FlashMLA takes multiples of 64 only, so 64 under a default of
    16 and the default itself from 0.34. `release` None: a caller with no engine in mind (tests,
    bench) gets the fallback release's (memory_model.DEFAULT_BLOCK_SIZE); the operator always
    passes the engine's (bounds.engine_block_size)."""
    default = DEFAULT_BLOCK_SIZE if release is None else release.default_block_size
    if shape.mla is not None:
        return default if default % MLA_BLOCK_SIZE == 0 else MLA_BLOCK_SIZE
    if release is None:
        return default
    table = release.surface.get("attention_block_sizes") or {}
    sizes = next((table[b] for b in STANDARD_BACKENDS if isinstance(table.get(b), list)), None)
    if not sizes or default in sizes:
        return default
    return int(min(sizes))


def stage_kv_layout(
    shape: ModelShape,
    tp: int,
    layers: range,
    *,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    block_size: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    null_blocks: int = NULL_BLOCKS,
) -> KVLayout:
    """The KV pool vLLM builds on a rank holding `layers`, grouped as its hybrid allocator does.
    Sliding and chunked layers hold their window plus the tokens in flight (two scheduler steps
    of max_num_batched_tokens, vLLM's async scheduling); a linear-attention state takes the
    pages vLLM gives it with prefix caching on (its default), aligned for its checkpoints.
    `block_size` and `null_blocks`: the engine's release's (None: `default_block_size`'s fallback)."""
    check_tp(shape, tp)
    kvb = kv_dtype_bytes(kv_cache_dtype, dtype)
    linear = shape.linear is not None
    return kv_layout(
        [layer_kv(shape, i, tp, kvb) for i in layers],
        block_size or default_block_size(shape),
        max_in_flight_tokens=IN_FLIGHT_STEPS * max_num_batched_tokens,
        mamba_pages_per_request=MAMBA_PAGES_WITH_PREFIX_CACHING if linear else 1,
        mamba_checkpoint_alignment=MAMBA_CHECKPOINT_ALIGNMENT if linear else 1,
        null_blocks=null_blocks,
    )


def kv_bytes_per_token(
    shape: ModelShape,
    tp: int = 1,
    kv_cache_dtype: str = "auto",
    *,
    dtype: str = "auto",
    layers: int | None = None,
) -> int:
    """KV bytes one token takes on ONE rank, summed over the first `layers` layers (all unless a
    PP stage's count is given): 2 (K and V) x kv_heads_per_rank x head_dim x kv dtype bytes per
    attention layer, MLA's latent per MLA layer; linear-attention layers hold a per-sequence
    state instead and add nothing per token. A display figure: budgets use `stage_kv_layout`."""
    check_tp(shape, tp)
    kvb = kv_dtype_bytes(kv_cache_dtype, dtype)
    n = shape.num_layers if layers is None else layers
    return sum(layer_kv(shape, i, tp, kvb).bytes_per_token for i in range(n))


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


def stage_layouts(
    shape: ModelShape,
    tp: int,
    *,
    pp: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    block_size: int | None = None,
    pp_layer_partition: Sequence[int] | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    null_blocks: int = NULL_BLOCKS,
) -> tuple[KVLayout, ...]:
    stages = stage_layers(shape, pp, pp_layer_partition)
    return tuple(
        stage_kv_layout(
            shape,
            tp,
            stage_range(stages, s),
            kv_cache_dtype=kv_cache_dtype,
            dtype=dtype,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            null_blocks=null_blocks,
        )
        for s in range(pp)
    )


def min_budget_for_one_request(
    shape: ModelShape,
    tp: int,
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    max_model_len: int | None = None,
    **split: Any,
) -> int:
    """The smallest --kv-cache-memory-bytes with which every rank still holds the blocks of one
    request at max_model_len plus the null block(s) the pool holds back (below it vLLM refuses
    to start with its kv_too_small message). The operator's shrink floor. `split`: pp, dtype,
    pp_layer_partition, max_num_batched_tokens, null_blocks, as `stage_layouts` takes them."""
    mml = resolve_max_model_len(shape, max_model_len)
    layouts = stage_layouts(shape, tp, kv_cache_dtype=kv_cache_dtype, block_size=block_size, **split)
    return max(lay.min_budget_bytes(mml) for lay in layouts)


def capacity_for_budget(
    shape: ModelShape,
    tp: int,
    budget_bytes: int,
    *,
    max_model_len: int | None = None,
    **layout: Any,
) -> Capacity:
    """Blocks, tokens and max concurrency at max_model_len that one per-GPU KV budget buys, as
    vLLM prints them (per replica, not x TP). `layout`: as `stage_layouts` takes it."""
    mml = resolve_max_model_len(shape, max_model_len)
    return capacity_of(stage_layouts(shape, tp, **layout), budget_bytes, mml)


def capacity_of(layouts: Sequence[KVLayout], budget_bytes: int, max_model_len: int) -> Capacity:
    """What a budget buys over the stages' layouts: the engine core takes the stage (rank) with
    the fewest blocks (the facts), and vLLM prints that stage's tokens and concurrency."""
    budget = max(0, budget_bytes)
    worst = min(layouts, key=lambda lay: lay.blocks(budget))
    return Capacity(
        blocks=worst.blocks(budget),
        tokens=worst.tokens(budget, max_model_len),
        max_concurrency=worst.max_concurrency(budget, max_model_len),
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
