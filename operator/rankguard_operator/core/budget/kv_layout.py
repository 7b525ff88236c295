"""How vLLM 0.33's (hybrid) KV-cache allocator turns one rank's per-layer KV specs and a per-GPU
budget (--kv-cache-memory-bytes) into blocks, printed tokens, printed max concurrency, and the
smallest budget it starts with. Every rule cites the vLLM function it copies; the numbers are
checked against the real package by tests/unit/core/budget/test_kv_layout.py (fixture written by
hack/vllm-snapshot/kv_layouts.py).

Assumes what a plain `vllm serve` on CUDA does: the default LBNHC layout (layer-outermost, so no
packed block-outermost grouping), no DCP, no speculative lookahead, no num_gpu_blocks_override,
one pipeline stage's layers grouped on their own (vLLM groups the whole model, then projects).

Pure: no I/O (the null-block count comes from the recorded vLLM snapshot).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from rankguard_operator import vllm_snapshots

Kind = Literal["full", "sliding", "chunked", "mla", "mamba"]
_ATTENTION: frozenset[str] = frozenset({"full", "sliding", "chunked", "mla"})

# BlockPool.__init__ (v1/core/block_pool.py) pops block 0 off the free queue for good as the
# null block; get_kv_cache_configs (v1/core/kv_cache_planning.py) reserves it before the check.
# Blocks the block pool holds back for good (vLLM >= 0.33's "null block", reserved before the
# too-small check): a budget must hold one request's blocks PLUS these, or vLLM refuses to start.
# Each release's count is its snapshot's engine.json (`Snapshot.null_blocks`), which the budget
# passes per engine (kv_model.stage_layouts); this is only the default of a layout built with no
# engine in mind (tests, bench): the fallback release's (vllm_snapshots.ESTIMATE_SIZING_RELEASE).
NULL_BLOCKS = vllm_snapshots.load(vllm_snapshots.ESTIMATE_SIZING_RELEASE).null_blocks
# VllmConfig.max_in_flight_tokens (config/vllm.py) = max_concurrent_batches x
# max_num_batched_tokens: 2 (async scheduling, PP1) x 8192 (engine/arg_utils.py
# get_batch_defaults, `vllm serve` on an H100/H200-class GPU). Only sliding/chunked layers use it.
DEFAULT_MAX_IN_FLIGHT_TOKENS = 2 * 8192
# FlashAttention's smallest kernel block on SM90: [MultipleOf(16)]
# (v1/attention/backends/flash_attn.py: get_supported_kernel_block_sizes).
DEFAULT_KERNEL_BLOCK = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerKV:
    kind: Kind
    bytes_per_token: int = 0  # this layer's KV bytes per token on ONE rank
    window: int = 0  # sliding window or attention chunk size, in tokens
    state_bytes: int = 0  # mamba / linear-attention state bytes per sequence on one rank


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: its layers share one block table (KVCacheGroupSpec)."""

    kind: Kind
    window: int
    layers: int
    block_size: int  # tokens per block of this group (0 for mamba: state pages hold no tokens)


@dataclass(frozen=True)
class _Spec:
    """One layer's KVCacheSpec, reduced to the fields that change the arithmetic (and equality)."""

    kind: Kind
    window: int
    per_token: int
    state: int
    block_size: int
    padded: int = 0  # page_size_padded; 0 = none

    @property
    def page(self) -> int:
        # AttentionSpec.page_size_bytes / MambaSpec.page_size_bytes (v1/kv_cache_interface.py).
        if self.padded:
            return self.padded
        return self.state if self.kind == "mamba" else self.block_size * self.per_token


@dataclass(frozen=True)
class KVLayout:
    """What vLLM builds for one rank (one pipeline stage) from its layers."""

    block_size: int  # tokens per block as vLLM ends up using it (raised for hybrid mamba models)
    page_bytes: int  # bytes one block of ONE layer takes (unified page size)
    bytes_per_block: int  # bytes the pool spends per block id (what the budget is divided by)
    groups: tuple[KVGroup, ...]  # in vLLM's order
    max_in_flight_tokens: int = DEFAULT_MAX_IN_FLIGHT_TOKENS
    mamba_pages_per_request: int = 1
    null_blocks: int = NULL_BLOCKS  # the engine's release's (Snapshot.null_blocks)

    def _group_pages(self, g: KVGroup, max_model_len: int) -> int:
        # cdiv(spec.max_memory_usage_bytes, page) per group (kv_cache_utils.py:
        # get_max_concurrency_for_kv_cache_config; kv_cache_planning.py:
        # _max_memory_usage_bytes_from_groups); the page cancels out of each formula.
        if g.kind == "mamba":
            # MambaSpec.max_memory_usage_bytes: 1 + spec blocks ("none"), 2 + spec + checkpoint ("align").
            return self.mamba_pages_per_request
        if g.kind == "sliding":
            # SlidingWindowSpec.max_admission_blocks_per_request: the window's last w-1 tokens plus
            # the in-flight ones, +1 since the window need not start on a block boundary.
            return _cdiv(min(g.window - 1 + self.max_in_flight_tokens, max_model_len), g.block_size) + 1
        if g.kind == "chunked":
            # ChunkedLocalAttentionSpec.max_admission_blocks_per_request: one chunk plus in-flight.
            return _cdiv(min(g.window + self.max_in_flight_tokens, max_model_len), g.block_size)
        return _cdiv(max_model_len, g.block_size)  # FullAttentionSpec (and MLA) hold every token

    def blocks_per_request(self, max_model_len: int) -> int:
        """Block ids one request of max_model_len tokens takes, summed over groups (one pool)."""
        return sum(self._group_pages(g, max_model_len) for g in self.groups)

    def blocks(self, budget_bytes: int) -> int:
        """num_blocks for that budget, null block included (get_kv_cache_configs:
        available_memory // bytes_per_block)."""
        return max(0, budget_bytes) // self.bytes_per_block

    def max_concurrency(self, budget_bytes: int, max_model_len: int) -> float:
        """vLLM's printed "Maximum concurrency": num_blocks (null block included) over the
        blocks of one request (kv_cache_utils.py: get_max_concurrency_for_kv_cache_config)."""
        return self.blocks(budget_bytes) / self.blocks_per_request(max_model_len)

    def tokens(self, budget_bytes: int, max_model_len: int) -> int:
        """vLLM's printed "GPU KV cache size: N tokens" = int(max_concurrency x max_model_len)
        (kv_cache_utils.py: get_kv_cache_capacity); needs max_model_len because of that."""
        return int(self.max_concurrency(budget_bytes, max_model_len) * max_model_len)

    def min_budget_bytes(self, max_model_len: int) -> int:
        """Smallest budget vLLM 0.33 starts with: _check_enough_kv_cache_memory wants one
        request's blocks x bytes_per_block within the budget less the null block
        (get_kv_cache_configs); anything below raises "... KV cache is needed"."""
        return self.bytes_per_block * (self.blocks_per_request(max_model_len) + self.null_blocks)


# One KV-cache group: the spec its layers share, and the indices of those layers.
_Group = tuple[_Spec, list[int]]


def _uniform(specs: Sequence[_Spec]) -> bool:
    # is_kv_cache_spec_uniform: every spec merges with the first (KVCacheSpec.merge: equality).
    return all(s == specs[0] for s in specs)


def _uniform_type(specs: Sequence[_Spec]) -> bool:
    # UniformTypeKVCacheSpecs.is_uniform_type: one block size and one registered type
    # (MLA is registered under FullAttentionSpec; sliding/chunked by window; mamba by page).
    first = specs[0]
    if len({s.block_size for s in specs}) > 1:
        return False
    if first.kind in ("full", "mla"):
        return all(s.kind in ("full", "mla") for s in specs)
    if first.kind == "mamba":
        return all(s.kind == "mamba" and s.page == first.page for s in specs)
    return all(s.kind == first.kind and s.window == first.window for s in specs)


def _align_mamba(specs: list[_Spec], block_size: int, kernel_block: int, ckpt_align: int) -> list[_Spec]:
    """platforms/interface.py: Platform._align_hybrid_block_size. Raise the attention block size
    until one attention page holds the largest mamba state, then pad mamba pages to that page."""
    attn = next(s for s in specs if s.kind != "mamba")
    mamba_page = max(s.state for s in specs if s.kind == "mamba")
    align = max(kernel_block, block_size)
    if any(s.kind == "mla" for s in specs):
        align = max(align, 128)  # TRTLLM/FlashInfer MLA decode wants 128-token multiples
    align = math.lcm(align, ckpt_align)  # "align" mode: prefill checkpoints on block boundaries
    need = align * _cdiv(mamba_page, align * attn.per_token)
    need = kernel_block * _cdiv(need, kernel_block)
    block_size = max(block_size, need)
    attn_page = block_size * attn.per_token
    pad = attn_page if attn_page != mamba_page else 0
    return [replace(s, padded=pad) if s.kind == "mamba" else replace(s, block_size=block_size) for s in specs]


def _promote(specs: list[_Spec]) -> list[_Spec]:
    """--disable-hybrid-kv-cache-manager (kv_cache_planning.py: unify_hybrid_kv_cache_specs ->
    _promote_local_kv_cache_specs): next to full attention, sliding and chunked layers are
    allocated as full attention (every token kept); anything else that is not one type fails."""
    if _uniform(specs) or _uniform_type(specs):
        return specs
    kinds = {s.kind for s in specs}
    if kinds & {"full", "mla"} and kinds & {"sliding", "chunked"}:
        full_bs = {s.block_size for s in specs if s.kind in ("full", "mla")}
        bs = next(iter(full_bs)) if len(full_bs) == 1 else 0
        specs = [
            replace(s, kind="full", window=0, block_size=bs or s.block_size)
            if s.kind in ("sliding", "chunked")
            else s
            for s in specs
        ]
    if not (_uniform(specs) or _uniform_type(specs)):
        raise ValueError("vLLM cannot run these layers without the hybrid KV cache manager")
    return specs


def _unify_pages(specs: list[_Spec]) -> list[_Spec]:
    """kv_cache_planning.py: unify_kv_cache_spec_page_size. Smaller pages grow to the largest:
    mamba by padding, others by a whole-number block-size ratio, non-MLA attention by padding."""
    top = max(s.page for s in specs)
    out = []
    for s in specs:
        if s.page == top:
            out.append(s)
        elif s.kind == "mamba":
            out.append(replace(s, padded=top))
        elif top % s.page == 0:
            out.append(replace(s, block_size=s.block_size * (top // s.page)))
        elif s.kind != "mla":
            out.append(replace(s, padded=top))
        else:
            raise ValueError(f"vLLM cannot unify an MLA page of {s.page} bytes with {top}")
    return out


def _split_groups(specs: list[_Spec]) -> list[_Group]:
    """kv_cache_planning.py: _get_kv_cache_groups_uniform_page_size. Layers bucket by spec (in
    first-seen order); every bucket splits into groups of group_size layers, layer i of a bucket
    going to group i % n, so all groups have (at most) the same layer count."""
    buckets: dict[_Spec, list[int]] = {}
    for i, s in enumerate(specs):
        buckets.setdefault(s, []).append(i)
    counts = [len(v) for v in buckets.values()]
    group_size = min(counts)
    if max(counts) < min(counts) * 1.5:  # few padding layers: use the largest count instead
        group_size = max(counts)
    groups: list[_Group] = []
    for spec, layers in buckets.items():
        n = _cdiv(len(layers), group_size)
        groups.extend((spec, layers[i::n]) for i in range(n))
    return groups


def _check_layers(layers: Sequence[LayerKV], block_size: int, kernel_block: int, ckpt_align: int) -> None:
    """Refuse what no vLLM spec can be built from (before any arithmetic, naming the layer kind)."""
    if not layers:
        raise ValueError("no KV layers: vLLM allocates no KV cache for attention-free models")
    if block_size < 1 or kernel_block < 1 or ckpt_align < 1:
        raise ValueError("block and kernel sizes must be positive")
    for layer in layers:
        if layer.kind == "mamba" and layer.state_bytes < 1:
            raise ValueError("a mamba layer needs state_bytes")
        if layer.kind != "mamba" and layer.bytes_per_token < 1:
            raise ValueError(f"a {layer.kind} layer needs bytes_per_token")
        if layer.kind in ("sliding", "chunked") and layer.window < 1:
            raise ValueError(f"a {layer.kind} layer needs a window")


def _layer_spec(layer: LayerKV, block_size: int) -> _Spec:
    """One layer's spec at `block_size`, with the fields its kind does not use zeroed (so that
    equal specs compare equal)."""
    mamba = layer.kind == "mamba"
    return _Spec(
        kind=layer.kind,
        window=layer.window if layer.kind in ("sliding", "chunked") else 0,
        per_token=0 if mamba else layer.bytes_per_token,
        state=layer.state_bytes if mamba else 0,
        block_size=0 if mamba else block_size,
    )


def _group_specs(specs: list[_Spec], kinds: set[Kind]) -> tuple[list[_Spec], list[_Group], int]:
    """get_kv_cache_groups, then the bytes one block id costs: (the specs as finally unified, the
    groups with their layers, bytes per block). One group when uniform (all layers one spec) or
    uniform-type (one type: _get_kv_cache_groups_uniform_type); otherwise unify pages and split."""
    one_group = _uniform(specs) or _uniform_type(specs)
    if not one_group:
        try:
            specs = _unify_pages(specs)
        except ValueError:
            # _try_get_full_allocation_fallback_groups: MLA next to plain sliding windows (and
            # no chunked layer) falls back to full-attention allocation in one group.
            if not ({"mla", "sliding"} <= kinds and "chunked" not in kinds):
                raise
            specs, one_group = _promote(specs), True
    if one_group:
        return specs, [(specs[0], list(range(len(specs))))], sum(s.page for s in specs)
    grouped = _split_groups(specs)
    # _get_kv_cache_bytes_per_block (layer-outer layout): the widest group's pages per block id.
    return specs, grouped, max(len(members) * spec.page for spec, members in grouped)


def kv_layout(
    layers: Sequence[LayerKV],
    block_size: int,
    *,
    hybrid_allocator: bool | None = None,
    max_in_flight_tokens: int = DEFAULT_MAX_IN_FLIGHT_TOKENS,
    mamba_pages_per_request: int = 1,
    kernel_block_size: int = DEFAULT_KERNEL_BLOCK,
    mamba_checkpoint_alignment: int = 1,
    null_blocks: int = NULL_BLOCKS,
) -> KVLayout:
    """The layout vLLM 0.33 builds (kv_cache_planning.py: get_kv_cache_groups, then
    get_kv_cache_config_from_groups) for one rank's layers at `block_size` (--block-size or
    the backend's choice, before the hybrid-mamba raise).

    hybrid_allocator: None = vLLM's default (config/vllm.py): on, except off when a layer uses
    chunked local attention. mamba_pages_per_request: MambaSpec.max_memory_usage_bytes / page,
    1 (+ speculative tokens) without prefix caching, 2 (+ spec + 1 FlashInfer-GDN checkpoint) with
    it. mamba_checkpoint_alignment: 64 for GDN on FlashInfer with prefix caching, else 1.
    null_blocks: the blocks the engine's release holds back (its snapshot's engine.json)."""
    _check_layers(layers, block_size, kernel_block_size, mamba_checkpoint_alignment)
    specs = [_layer_spec(x, block_size) for x in layers]
    kinds = {s.kind for s in specs}
    if "mamba" in kinds and kinds & _ATTENTION:
        specs = _align_mamba(specs, block_size, kernel_block_size, mamba_checkpoint_alignment)
    if hybrid_allocator is None:
        hybrid_allocator = "chunked" not in kinds
    if not hybrid_allocator:
        specs = _promote(specs)
    specs, grouped, per_block = _group_specs(specs, kinds)
    attn_bs = [s.block_size for s, _ in grouped if s.kind != "mamba"]
    return KVLayout(
        block_size=min(attn_bs) if attn_bs else block_size,
        page_bytes=max(s.page for s in specs),
        bytes_per_block=per_block,
        groups=tuple(KVGroup(s.kind, s.window, len(m), s.block_size) for s, m in grouped),
        max_in_flight_tokens=max_in_flight_tokens,
        mamba_pages_per_request=mamba_pages_per_request,
        null_blocks=null_blocks,
    )
