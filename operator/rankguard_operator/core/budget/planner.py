"""The per-rank KV-cache budget planner. Pure functions over plain data: no I/O, no clock.

`make_plan` reads top to bottom in named steps (each stage's shared figures, each rank's memory
beside its KV cache, the budget the tightest rank sets, the equivalent utilisation, the
warnings), with its input and output types beside it; the pieces it adds up live in
`memory_model`, `model.weights` and `kv_model`. (Over 450 lines because the plan's types and the
steps that fill them are one computation: apart, neither half reads without the other.)

Why per rank: under tensor parallelism vLLM applies ONE KV budget to every rank (it takes the
minimum of the workers' block counts, and `--kv-cache-memory-bytes` is one number "per GPU"),
but non-KV memory differs by rank: the logits buffer (gathered to rank 0 in vLLM v0 / the
article, all-gathered on every rank in vLLM v1), NCCL buffers, the pipeline-terminal stage
under PP. So the budget must come from the rank with the least room, and that rank must be
named, never assumed to be rank 0. Sources: shared/reference/rank0-oom-article.txt ("the
article") and shared/reference/vllm-memory-facts.md ("the facts").

API
---
    shape = resolve_model("meta-llama/Meta-Llama-3-70B")            # rankguard_operator.core.model.resolve
    plan = make_plan(PlanInput(shape=shape, tp=8, gpu_memory_bytes=80 * GiB,
                               max_num_seqs=128, logits_mode="gather"))
    plan.kv_cache_memory_bytes   # pass as --kv-cache-memory-bytes (same on every rank)
    plan.bottleneck_rank         # the rank that sets it
    plan.ranks[r]                # RankPlan: weights, logits, sampler, activation, context/NCCL,
                                 #   CUDA graphs, non-KV total, safe KV, headroom at the budget
    plan.gpu_memory_utilization  # the equivalent --gpu-memory-utilization (when one exists)
    plan.kv_blocks, plan.kv_tokens, plan.max_concurrency, plan.skew_loss_bytes

Measurements replace priors rank by rank: `RankMeasurement(rank, total_bytes=...,
free_after_init_bytes=...)` (free memory after CUDA context + NCCL init, e.g. the agent's
probe) replaces the context/NCCL prior; `peak_non_kv_bytes` (observed peak use of everything
but the KV pool, context included) replaces the whole non-KV estimate.

Building blocks for the operator's policy (shrink/grow, status): `kv_bytes_per_token`,
`min_budget_for_one_request` (the floor that still serves one request at max_model_len),
`capacity_for_budget` (blocks / tokens / max concurrency for any budget),
`pp_layer_partition`, `weight_bytes`, `logits_bytes`.

Budget rounding: `kv_cache_memory_bytes` is floored to a whole number of KV blocks of the
rank whose blocks are largest, so that rank uses the budget exactly and no rank is promised
bytes it cannot turn into a block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from rankguard_operator.core.budget.kv_layout import NULL_BLOCKS, KVLayout
from rankguard_operator.core.budget.kv_model import (
    capacity_of,
    layer_kv,
    resolve_max_model_len,
    stage_layers,
    stage_layouts,
    stage_range,
)
from rankguard_operator.core.budget.memory_model import (
    CONTEXT_FLOOR_BYTES,
    DEFAULT_BLOCK_SIZE,
    LOGITS_BYTES_PER_VALUE,
    SAMPLER_FP32_COPIES,
    Capacity,
    PlanError,
    act_bytes,
    activation_bytes,
    capture_sizes,
    check_tp,
    context_prior_bytes,
    cudagraph_bytes,
    kv_dtype_bytes,
    logits_bytes,
    profile_comm_bytes,
    runtime_peak_bytes,
    weight_bits,
    weight_bytes,
)
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.spec.crd import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SAFETY_MARGIN_BYTES,
    LOGITS_MODES,
    LogitsMode,
)
from rankguard_operator.core.units import format_bytes

# --------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class RankMeasurement:
    """What was measured on one rank; any figure may be missing.

    free_after_init_bytes: free device memory after CUDA context and NCCL init (the agent's
        probe, or vLLM's startup snapshot); total − this replaces the context/NCCL prior.
    peak_non_kv_bytes: the most memory this rank used for anything but the KV pool, context
        and NCCL included (e.g. NVML used minus the KV pool at the worst moment); replaces the
        whole non-KV estimate.
    total_bytes: the device's total memory (replaces PlanInput.gpu_memory_bytes for this rank).
    engine_non_kv_bytes: the engine's own account of everything but the KV pool (vLLM's
        per-worker memory report at start-up, others' memory on the device included). It may
        only TIGHTEN the rank's non-KV figure, never loosen it (docs/architecture.md: it is
        measured before traffic, so NCCL's lazily allocated buffers are not in it).
    """

    rank: int
    total_bytes: int | None = None
    free_after_init_bytes: int | None = None
    peak_non_kv_bytes: int | None = None
    engine_non_kv_bytes: int | None = None


@dataclass(frozen=True)
class PlanInput:
    shape: ModelShape
    gpu_memory_bytes: int  # total memory of one GPU
    tp: int = 1
    pp: int = 1
    dtype: str = "auto"  # vLLM --dtype: activations and unquantised weights
    weight_dtype: str = "auto"  # auto: the checkpoint's quantisation if known, else `dtype`
    kv_cache_dtype: str = "auto"  # vLLM --kv-cache-dtype; auto = `dtype`
    # tokens per KV block and blocks the pool holds back, as the engine's release has them
    # (bounds.plan_input: the image's vLLM; the defaults are only a fallback for hand-built input)
    block_size: int = DEFAULT_BLOCK_SIZE
    null_blocks: int = NULL_BLOCKS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # None: the model's max_position_embeddings, as vLLM does
    logits_mode: LogitsMode = "all-gather"
    safety_margin_bytes: int = DEFAULT_SAFETY_MARGIN_BYTES
    enforce_eager: bool = False
    measured: tuple[RankMeasurement, ...] = ()
    pp_layer_partition: tuple[int, ...] | None = None  # as VLLM_PP_LAYER_PARTITION; None: vLLM's split
    quantization: str | None = None  # vLLM --quantization on an unquantised checkpoint (e.g. fp8)
    # Weight bytes per rank read from the checkpoint's own headers (`model.checkpoint`),
    # indexed by global rank; replaces the config.json arithmetic where given.
    checkpoint_weights: tuple[int, ...] | None = None
    # Measure-first (an architecture the priors cannot describe): every rank's non-KV figure
    # comes from the engine's own report or an observed peak; nothing is estimated.
    measured_only: bool = False
    # Pods one replica spans (spec.distributed.podsPerGroup): more pods than pipeline stages
    # means a TP group spans nodes, whose NCCL (no custom all-reduce) costs more.
    pods: int = 1

    @property
    def cross_node_tp(self) -> bool:
        return self.pods > self.pp


@dataclass(frozen=True)
class RankPlan:
    rank: int  # global rank = pp_stage * tp + tp_rank (vLLM's numbering)
    pp_stage: int
    tp_rank: int
    layers: int
    total_bytes: int
    weights_bytes: int
    logits_bytes: int
    sampler_bytes: int
    activation_bytes: int
    context_bytes: int  # CUDA context + NCCL + custom all-reduce: outside vLLM's own accounting
    context_source: str  # "prior" | "measured"
    cudagraph_bytes: int
    non_kv_bytes: int
    non_kv_source: str  # "estimate" | "measured-peak" | "engine" (vLLM's own report, larger)
    safe_kv_bytes: int  # total − non-KV: the most KV this rank can hold (negative: does not fit)
    kv_bytes_per_token: int
    blocks: int  # blocks this rank could cut from the planned budget
    headroom_bytes: int  # safe KV − planned budget: what this rank keeps free while serving
    weights_source: str = "config"  # "config" (config.json arithmetic) | "checkpoint" (its headers)
    profile_comm_bytes: int = 0  # NCCL memory the profile run allocates after vLLM's snapshot
    # The least non-KV memory this rank can need (weights, the smallest non-torch memory seen,
    # the fp32 logits; or the measured figure): the feasibility verdict's side, never a budget's.
    least_non_kv_bytes: int = 0

    @property
    def runtime_non_kv_bytes(self) -> int:
        """The part of non-KV that vLLM itself measures and subtracts from its requested memory."""
        return self.non_kv_bytes - self.context_bytes


@dataclass(frozen=True)
class Plan:
    inputs: PlanInput
    max_model_len: int
    ranks: tuple[RankPlan, ...]
    bottleneck_rank: int
    kv_bytes_per_token: int  # per rank (the largest, if PP stages differ)
    block_bytes: (
        int  # bytes of one KV block id on the rank whose blocks are largest: budgets are whole blocks
    )
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    utilization_kv_bytes: int  # what the equivalent utilisation would give the bottleneck
    kv_blocks: int
    kv_tokens: int
    max_concurrency: float
    min_kv_cache_memory_bytes: int  # one request at max_model_len
    naive_kv_cache_memory_bytes: int
    skew_loss_bytes: int
    skew_loss_tokens: int
    feasible: bool
    warnings: tuple[str, ...] = field(default_factory=tuple)
    layouts: tuple[KVLayout, ...] = ()  # each pipeline stage's KV pool, as vLLM groups it

    def capacity(self, budget_bytes: int) -> Capacity:
        """Blocks, tokens and max concurrency a per-GPU budget buys under this plan, as vLLM
        prints them."""
        return capacity_of(self.layouts, budget_bytes, self.max_model_len)


# --------------------------------------------------------------------------------------------
# The plan


def _check_input(inp: PlanInput) -> int:
    shape = inp.shape
    check_tp(shape, inp.tp)
    if isinstance(inp.pp, bool) or not isinstance(inp.pp, int) or inp.pp < 1:
        raise PlanError(f"pipeline parallel size must be a positive integer, got {inp.pp!r}")
    stage_layers(shape, inp.pp, inp.pp_layer_partition)
    if inp.gpu_memory_bytes <= 0:
        raise PlanError(f"GPU memory must be positive, got {inp.gpu_memory_bytes!r}")
    if inp.logits_mode not in LOGITS_MODES:
        raise PlanError(f"logits mode {inp.logits_mode!r} is not one of {', '.join(LOGITS_MODES)}")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        v = getattr(inp, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    if inp.max_num_batched_tokens < inp.max_num_seqs:
        raise PlanError(
            f"max_num_batched_tokens ({inp.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({inp.max_num_seqs}), as vLLM requires"
        )
    if inp.safety_margin_bytes < 0:
        raise PlanError(f"safety margin must be >= 0, got {inp.safety_margin_bytes}")
    act_bytes(inp.dtype)
    kv_dtype_bytes(inp.kv_cache_dtype, inp.dtype)
    weight_bits(shape, inp.weight_dtype, inp.dtype)
    world = inp.tp * inp.pp
    seen: set[int] = set()
    for m in inp.measured:
        if not 0 <= m.rank < world:
            raise PlanError(f"measurement for rank {m.rank}, but ranks are 0..{world - 1}")
        if m.rank in seen:
            raise PlanError(f"two measurements for rank {m.rank}")
        seen.add(m.rank)
        total = m.total_bytes if m.total_bytes is not None else inp.gpu_memory_bytes
        for name in ("total_bytes", "free_after_init_bytes", "peak_non_kv_bytes"):
            v = getattr(m, name)
            if v is not None and (v < 0 or v > total):
                raise PlanError(f"rank {m.rank}: measured {name} {v} is outside [0, {total}]")
    return resolve_max_model_len(shape, inp.max_model_len)


def _floor4(x: float) -> float:
    return math.floor(x * 10000) / 10000


@dataclass(frozen=True)
class _StageFigures:
    """What every TP rank of one pipeline stage shares, worked out once per stage."""

    stage: int
    layers: int
    kv_bytes_per_token: int
    config_weights: int  # config.json arithmetic; 0 when the checkpoint's headers give the weights
    activation: int
    cudagraphs: int
    profile_comm: int


def _stage_figures(inp: PlanInput) -> Iterator[_StageFigures]:
    """Stage by stage, lazily: a stage's weights are worked out when its first rank is drafted, so
    an earlier rank's error (a missing measurement) is the one raised."""
    shape, tp, pp = inp.shape, inp.tp, inp.pp
    stages = stage_layers(shape, pp, inp.pp_layer_partition)
    ranges = [stage_range(stages, st) for st in range(pp)]
    kvb = kv_dtype_bytes(inp.kv_cache_dtype, inp.dtype)
    per_token = [sum(layer_kv(shape, i, tp, kvb).bytes_per_token for i in ranges[st]) for st in range(pp)]
    act = activation_bytes(shape, tp, inp.max_num_batched_tokens, inp.dtype)
    n_graphs = 0 if inp.enforce_eager else capture_sizes(inp.max_num_seqs, inp.max_num_batched_tokens)
    comm = profile_comm_bytes(tp, pp, cross_node=inp.cross_node_tp)
    for st in range(pp):
        yield _StageFigures(
            stage=st,
            layers=stages[st],
            kv_bytes_per_token=per_token[st],
            # every TP rank of a stage holds the same weights
            config_weights=0 if inp.checkpoint_weights is not None else _config_weights(inp, stages, st),
            activation=act,
            cudagraphs=cudagraph_bytes(stages[st], tp, n_graphs, cross_node=inp.cross_node_tp),
            profile_comm=comm,
        )


def _config_weights(inp: PlanInput, stages: tuple[int, ...], stage: int) -> int:
    return weight_bytes(
        inp.shape,
        inp.tp,
        pp_stage=stage,
        pp=inp.pp,
        layers=stages[stage],
        first_layer=stage_range(stages, stage).start,
        dtype=inp.dtype,
        weight_dtype=inp.weight_dtype,
        quantization=inp.quantization,
    )


def _logits_and_sampler(inp: PlanInput, stage: int, tp_rank: int) -> tuple[int, int]:
    """The logits buffer and the sampler's fp32 copies on one rank: only the last stage computes
    logits, and only a rank that holds the full logits (every rank when all-gathered) samples."""
    terminal = stage == inp.pp - 1
    if not terminal:
        return 0, 0
    logits = logits_bytes(inp.shape, inp.tp, inp.max_num_seqs, inp.logits_mode, tp_rank=tp_rank)
    if inp.logits_mode != "all-gather" and tp_rank != 0:
        return logits, 0
    return logits, SAMPLER_FP32_COPIES * inp.shape.vocab_size * inp.max_num_seqs * LOGITS_BYTES_PER_VALUE


def _context(inp: PlanInput, m: RankMeasurement | None, rank: int, total: int) -> tuple[int, str]:
    """CUDA context + NCCL: measured (total minus free after init) where the agent saw it, else the prior."""
    if m is not None and m.free_after_init_bytes is not None:
        return total - m.free_after_init_bytes, "measured"
    return context_prior_bytes(rank, inp.tp, inp.pp), "prior"


def _non_kv(
    m: RankMeasurement | None, rank: int, context: int, estimate: int, *, measured_only: bool
) -> tuple[int, str]:
    """The rank's non-KV figure and its source: an observed peak replaces the estimate, and the
    engine's own report may only raise it (see RankMeasurement)."""
    if measured_only:
        seen = [v for v in (m.engine_non_kv_bytes, m.peak_non_kv_bytes) if v is not None] if m else []
        if not seen:
            raise PlanError(f"rank {rank} has no measured non-KV figure; a measure-first plan needs one")
        estimate = max(context, *seen)
    non_kv, source = estimate, "estimate"
    if m is not None and m.peak_non_kv_bytes is not None:
        # the observation includes context; never let the runtime part go below zero
        non_kv, source = max(m.peak_non_kv_bytes, context), "measured-peak"
    if m is not None and m.engine_non_kv_bytes is not None and m.engine_non_kv_bytes > non_kv:
        non_kv, source = m.engine_non_kv_bytes, "engine"
    return non_kv, source


def _draft_rank(inp: PlanInput, fig: _StageFigures, tp_rank: int, m: RankMeasurement | None) -> RankPlan:
    """One rank's memory beside its KV cache; blocks and headroom wait for the budget (zero here)."""
    rank = fig.stage * inp.tp + tp_rank
    total = m.total_bytes if m is not None and m.total_bytes is not None else inp.gpu_memory_bytes
    if inp.checkpoint_weights is not None:
        weights, weights_source = inp.checkpoint_weights[rank], "checkpoint"
    else:
        weights, weights_source = fig.config_weights, "config"
    logits, sampler = _logits_and_sampler(inp, fig.stage, tp_rank)
    context, context_source = _context(inp, m, rank, total)
    estimate = (
        context
        + weights
        + runtime_peak_bytes(fig.activation, logits, sampler)
        + fig.cudagraphs
        + fig.profile_comm
    )
    non_kv, non_kv_source = _non_kv(m, rank, context, estimate, measured_only=inp.measured_only)
    least = (
        non_kv
        if non_kv_source != "estimate"
        else weights + logits + (context if context_source == "measured" else CONTEXT_FLOOR_BYTES)
    )
    return RankPlan(
        rank=rank,
        pp_stage=fig.stage,
        tp_rank=tp_rank,
        layers=fig.layers,
        total_bytes=total,
        weights_bytes=weights,
        logits_bytes=logits,
        sampler_bytes=sampler,
        activation_bytes=fig.activation,
        context_bytes=context,
        context_source=context_source,
        cudagraph_bytes=fig.cudagraphs,
        non_kv_bytes=non_kv,
        non_kv_source=non_kv_source,
        safe_kv_bytes=total - non_kv,
        kv_bytes_per_token=fig.kv_bytes_per_token,
        blocks=0,
        headroom_bytes=0,
        weights_source=weights_source,
        profile_comm_bytes=fig.profile_comm,
        least_non_kv_bytes=min(least, non_kv),
    )


def _draft_ranks(inp: PlanInput) -> list[RankPlan]:
    """Every rank of the replica in vLLM's order (global rank = pp_stage * tp + tp_rank)."""
    measured = {m.rank: m for m in inp.measured}
    return [
        _draft_rank(inp, fig, tp_rank, measured.get(fig.stage * inp.tp + tp_rank))
        for fig in _stage_figures(inp)
        for tp_rank in range(inp.tp)
    ]


def _budgets(drafts: list[RankPlan], block_unit: int, margin: int) -> tuple[RankPlan, int, int]:
    """(the bottleneck rank, the budget it sets, the naive budget the roomiest rank would set),
    both whole blocks after the safety margin."""
    # ties go to the lowest rank, so an even split names rank 0, as vLLM's reports would
    bottleneck = min(drafts, key=lambda r: (r.safe_kv_bytes, r.rank))
    budget = max(0, (bottleneck.safe_kv_bytes - margin) // block_unit * block_unit)
    best = max(r.safe_kv_bytes for r in drafts)
    naive = max(0, (best - margin) // block_unit * block_unit)
    return bottleneck, budget, naive


def _utilization(ranks: tuple[RankPlan, ...], budget: int) -> tuple[float, int, float, float]:
    """(the equivalent --gpu-memory-utilization, the KV it gives the bottleneck, the utilisation
    the budget needs, the most that free memory after init allows)."""
    # vLLM sizes KV as util × total − (what it measures: non-KV minus context), per rank, and
    # refuses to start when util × total exceeds free memory after init (the facts).
    needed = max((budget + r.runtime_non_kv_bytes) / r.total_bytes for r in ranks)
    startup_cap = min((r.total_bytes - r.context_bytes) / r.total_bytes for r in ranks)
    util = max(0.0, _floor4(min(needed, startup_cap, 1.0)))
    util_kv = max(0, min(math.floor(util * r.total_bytes) - r.runtime_non_kv_bytes for r in ranks))
    return util, util_kv, needed, startup_cap


def _no_room_warnings(ranks: tuple[RankPlan, ...]) -> list[str]:
    return [
        f"rank {r.rank}: weights and overheads ({format_bytes(r.non_kv_bytes)}) leave no room "
        f"for any KV cache on a {format_bytes(r.total_bytes)} GPU; raise TP/PP or use a larger GPU"
        for r in ranks
        if r.safe_kv_bytes <= 0
    ]


def _one_request_warnings(
    feasible: bool, most: int, floor: int, *, budget: int, bottleneck_rank: int, mml: int
) -> list[str]:
    if not feasible:
        return [
            f"even the least a rank needs beside its KV cache leaves {format_bytes(max(0, most))}, which "
            f"cannot hold one request of max_model_len {mml} ({format_bytes(floor)}); lower "
            "max_model_len, raise TP, or use an fp8 KV cache"
        ]
    if budget < floor:
        return [
            f"the planned KV budget {format_bytes(budget)} (rank {bottleneck_rank}) is below one request "
            f"of max_model_len {mml} ({format_bytes(floor)}) under the priors; it starts at that floor"
        ]
    return []


def _utilization_warnings(needed: float, startup_cap: float, budget: int, util_kv: int) -> list[str]:
    if needed > startup_cap and budget > 0:
        return [
            f"no --gpu-memory-utilization reproduces this budget: free memory after init caps it at "
            f"{_floor4(startup_cap)}, which gives {format_bytes(util_kv)} of KV; use --kv-cache-memory-bytes"
        ]
    return []


def _context_length_warnings(shape: ModelShape, mml: int) -> list[str]:
    if shape.max_position_embeddings is not None and mml > shape.max_position_embeddings:
        return [
            f"max_model_len {mml} exceeds the model's max_position_embeddings "
            f"{shape.max_position_embeddings}; vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
        ]
    return []


@functools.lru_cache(maxsize=4096)
def make_plan(inp: PlanInput) -> Plan:
    """Plan the per-GPU KV budget for every rank of one replica. Raises PlanError on impossible input.

    Cached: every pass of every service plans again from the same inputs (a frozen, hashable
    PlanInput) to the same frozen Plan; at a thousand services planning was a third of a pass."""
    mml = _check_input(inp)
    layouts = stage_layouts(
        inp.shape,
        inp.tp,
        pp=inp.pp,
        kv_cache_dtype=inp.kv_cache_dtype,
        dtype=inp.dtype,
        block_size=inp.block_size,
        pp_layer_partition=inp.pp_layer_partition,
        max_num_batched_tokens=inp.max_num_batched_tokens,
        null_blocks=inp.null_blocks,
    )
    drafts = _draft_ranks(inp)
    block_unit = max(lay.bytes_per_block for lay in layouts)
    bottleneck, budget, naive = _budgets(drafts, block_unit, inp.safety_margin_bytes)
    ranks = tuple(
        replace(r, blocks=layouts[r.pp_stage].blocks(budget), headroom_bytes=r.safe_kv_bytes - budget)
        for r in drafts
    )
    cap, naive_cap = capacity_of(layouts, budget, mml), capacity_of(layouts, naive, mml)
    # one request at max_model_len plus the null block(s), on the stage that needs the most
    floor = max(lay.min_budget_bytes(mml) for lay in layouts)
    util, util_kv, needed, startup_cap = _utilization(ranks, budget)
    # Feasible unless even the least each rank can need leaves no room for one request: the
    # priors (and the safety margin) size the budget, but a verdict from them would refuse
    # what vLLM serves (a 72B model at TP2 on 80 GB cards, an 8B model at 20K on a 24 GB card).
    most = min(r.total_bytes - r.least_non_kv_bytes for r in ranks)
    feasible = most >= floor > 0
    warnings = [
        *_no_room_warnings(ranks),
        *_one_request_warnings(
            feasible, most, floor, budget=budget, bottleneck_rank=bottleneck.rank, mml=mml
        ),
        *_utilization_warnings(needed, startup_cap, budget, util_kv),
        *_context_length_warnings(inp.shape, mml),
    ]
    return Plan(
        inputs=inp,
        max_model_len=mml,
        ranks=ranks,
        bottleneck_rank=bottleneck.rank,
        kv_bytes_per_token=max(r.kv_bytes_per_token for r in ranks),
        block_bytes=block_unit,
        kv_cache_memory_bytes=budget,
        gpu_memory_utilization=util,
        utilization_kv_bytes=util_kv,
        kv_blocks=cap.blocks,
        kv_tokens=cap.tokens,
        max_concurrency=cap.max_concurrency,
        min_kv_cache_memory_bytes=floor,
        naive_kv_cache_memory_bytes=naive,
        skew_loss_bytes=naive - budget,
        skew_loss_tokens=naive_cap.tokens - cap.tokens,
        feasible=feasible,
        warnings=tuple(warnings),
        layouts=tuple(layouts),
    )
