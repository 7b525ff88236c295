"""Budget bounds for one LLMService: its plan, floor, ceiling, block unit and budget key.

The bridge between the spec and the planner: `initial_plan` turns a `ServiceSpec` (plus
probe figures or measured GPU totals, when there are any) into a `Plan`; `kv_floor` and
`kv_ceiling` are the guard rails every budget the policy chooses is clamped to; `budget_key`
fingerprints the spec fields a budget was computed for, so a spec change re-plans instead of
keeping a budget sized for something else.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.kv_model import default_block_size
from rankguard_operator.core.budget.memory_model import (
    PlanError,
    act_bytes,
    lazy_comm_prior_bytes,
    pp_layer_partition,
    runtime_peak_bytes,
)
from rankguard_operator.core.budget.planner import Plan, PlanInput, RankMeasurement, make_plan
from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.model.checkpoint import CheckpointError, checkpoint_rank_weights
from rankguard_operator.core.model.resolve import ModelResolution, resolve
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.units import MiB

# With no plan to say how big a KV block is, budgets are rounded to whole MiB.
FALLBACK_UNIT_BYTES = MiB


def _usable(measured: Sequence[RankMeasurement], world: int) -> tuple[RankMeasurement, ...]:
    """Measurements the planner can take: ranks of this world size (during a TP change the old
    pods report other ranks), at most one per rank, figures within the device's total."""
    out: dict[int, RankMeasurement] = {}
    for m in measured:
        if not 0 <= m.rank < world or m.rank in out:
            continue
        total = m.total_bytes
        if total is not None and total <= 0:
            continue
        if total is not None and m.free_after_init_bytes is not None and m.free_after_init_bytes > total:
            continue
        out[m.rank] = m
    return tuple(out[r] for r in sorted(out))


def gpu_memory_bytes(spec: ServiceSpec, measured: Sequence[RankMeasurement] = ()) -> int | None:
    """One GPU's total memory: the smallest measured total (the truth), else spec.memory.gpuMemoryBytes."""
    totals = [m.total_bytes for m in measured if m.total_bytes is not None and m.total_bytes > 0]
    if totals:
        return min(totals)
    return spec.memory.gpu_memory_bytes


def engine_release(spec: ServiceSpec) -> vllm_snapshots.Snapshot:
    """The recorded release whose KV facts (default block size, null blocks) the budget uses:
    the image's vLLM, learned from its tag as the spec's extraArgs and blockSize are judged
    (core/engine/rules: the nearest older snapshot for an unrecorded release, the newest for a
    tag that names none). The tag, not the version an agent reports: it is in the spec, so a
    budget planned with it stays put when the engine starts and reports."""
    return rules_for_image(spec.image).snapshot


def engine_block_size(spec: ServiceSpec, shape: ModelShape) -> int:
    """Tokens per KV block the engine will use: spec.engine.blockSize, else its release's own
    choice for this model (kv_model.default_block_size: 16 up to vLLM 0.33, 64 from 0.34)."""
    return spec.engine.block_size or default_block_size(shape, engine_release(spec))


def plan_input(
    spec: ServiceSpec,
    shape: ModelShape,
    gpu_bytes: int,
    measured: Sequence[RankMeasurement] = (),
    *,
    checkpoint: Any = None,
    measured_only: bool = False,
) -> PlanInput:
    e = spec.engine
    usable = _usable(measured, spec.world_size)
    # a measurement without its own total is checked against the spec's GPU size
    usable = tuple(
        m
        for m in usable
        if m.total_bytes is not None
        or m.free_after_init_bytes is None
        or m.free_after_init_bytes <= gpu_bytes
    )
    return PlanInput(
        shape=shape,
        gpu_memory_bytes=gpu_bytes,
        tp=spec.tp,
        pp=spec.pp,
        dtype=e.dtype,
        kv_cache_dtype=e.kv_cache_dtype,
        block_size=engine_block_size(spec, shape),
        null_blocks=engine_release(spec).null_blocks,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len,
        logits_mode="gather" if e.logits_mode == "gather" else "all-gather",
        safety_margin_bytes=spec.memory.safety_margin_bytes,
        enforce_eager=e.enforce_eager,
        measured=usable,
        quantization=spec.model.quantization,
        checkpoint_weights=_checkpoint_weights(spec, shape, checkpoint),
        measured_only=measured_only,
        pods=spec.pods_per_replica,
    )


def _checkpoint_weights(spec: ServiceSpec, shape: ModelShape, checkpoint: Any) -> tuple[int, ...] | None:
    """Per-rank weight bytes from the checkpoint's headers, when the agent read them and they
    fit the model; None (config.json arithmetic) otherwise."""
    if checkpoint is None:
        return None
    try:
        return checkpoint_rank_weights(
            checkpoint,
            shape,
            tp=spec.tp,
            pp=spec.pp,
            stages=pp_layer_partition(shape.num_layers, spec.pp),
            act=act_bytes(spec.engine.dtype),
            runtime_fp8=spec.model.quantization == "fp8",
        )
    except (CheckpointError, PlanError):
        return None


def initial_plan(
    spec: ServiceSpec,
    *,
    measured: Sequence[RankMeasurement] = (),
    model: ModelResolution | None = None,
) -> Plan | None:
    """The planner's budget for this spec: from priors, with probe figures / measured totals
    replacing them rank by rank when given. `model` says where the shape came from (the
    reconcile step resolves it once per pass); without it, the spec alone is resolved (its
    figures or the catalog). None while one GPU's size is unknown (no spec.memory.gpuMemoryBytes
    and nothing measured yet), while nothing describes the model, and for a measure-first model
    until every rank's engine report is in. Raises SpecError when the spec cannot be planned (TP
    that does not divide the heads, ...)."""
    if model is None:
        model = resolve(spec)
    if model.shape is None:
        return None
    shape, checkpoint, measured_only = model.shape, model.checkpoint, model.measure_first
    usable = _usable(measured, spec.world_size)
    gpu = gpu_memory_bytes(spec, usable)
    if gpu is None:
        return None
    if measured_only and (
        len(usable) < spec.world_size
        or any(m.engine_non_kv_bytes is None and m.peak_non_kv_bytes is None for m in usable)
    ):
        return None  # measure-first: every rank's own non-KV figure, or no plan yet
    try:
        return make_plan(
            plan_input(spec, shape, gpu, measured, checkpoint=checkpoint, measured_only=measured_only)
        )
    except PlanError as exc:
        raise SpecError(f"spec cannot be planned: {exc}") from None


def is_measured(plan: Plan | None) -> bool:
    """The plan used a probe figure for at least one rank (not only priors)."""
    return plan is not None and any(r.context_source == "measured" for r in plan.ranks)


def block_unit(plan: Plan | None) -> int:
    """Bytes of one KV block on the rank whose blocks are largest: budgets are whole blocks."""
    if plan is None:
        return FALLBACK_UNIT_BYTES
    return plan.block_bytes


def round_down(n: int, unit: int) -> int:
    return max(0, n // unit * unit)


def kv_floor(spec: ServiceSpec, plan: Plan | None) -> int:
    """The smallest budget rankguard will run: one request at max_model_len (the planner's
    minimum, when there is a plan) and spec.remediation.minKVCacheBytes, whichever is larger."""
    floor = 1
    if plan is not None:
        floor = max(floor, plan.min_kv_cache_memory_bytes)
    if spec.remediation.min_kv_cache_bytes is not None:
        floor = max(floor, spec.remediation.min_kv_cache_bytes)
    return floor


def kv_ceiling(spec: ServiceSpec, plan: Plan | None) -> int | None:
    """The largest budget growing may reach: spec.remediation.maxKVCacheBytes and the plan's
    maximum (the bottleneck rank's safe KV: its memory minus the planned non-KV, before the
    safety margin), whichever is smaller. None when neither exists: then rankguard never grows."""
    bounds: list[int] = []
    if spec.remediation.max_kv_cache_bytes is not None:
        bounds.append(spec.remediation.max_kv_cache_bytes)
    if plan is not None:
        safe = min(r.safe_kv_bytes for r in plan.ranks)
        bounds.append(round_down(safe, block_unit(plan)))
    return min(bounds) if bounds else None


def after_kv_bytes(plan: Plan, rank: int | None, *, enforce_eager: bool) -> int:
    """What a rank allocates after its KV cache when the engine sizes the cache before capturing
    graphs (estimate sizing, or any byte budget), by the plan: the CUDA-graph pool (none under
    --enforce-eager), then the sampler warm-up's logits and fp32 copies, which a serving step's
    transients reuse (`runtime_peak_bytes`: the larger of them and the activations), and on a
    pipeline-terminal rank the NCCL memory the first pipeline traffic creates
    (`lazy_comm_prior_bytes`). Start-up order: EngineMemoryModel.startup (allocate_kv,
    capture_cuda_graphs, warm_up_sampler), then start_serving. Under a byte budget all of it comes
    out of what the KV cache left free. `rank` None: the largest of every rank's."""
    inp = plan.inputs
    ranks = [r for r in plan.ranks if rank is None or r.rank == rank] or list(plan.ranks)
    return max(
        (0 if enforce_eager else r.cudagraph_bytes)
        + runtime_peak_bytes(r.activation_bytes, r.logits_bytes, r.sampler_bytes)
        + lazy_comm_prior_bytes(r.rank, inp.tp, inp.pp)
        for r in ranks
    )


def equivalent_utilization(plan: Plan, kv_bytes: int) -> float:
    """The --gpu-memory-utilization that would give `kv_bytes` on every rank of `plan`
    (vLLM: KV = util × total − what it measures), capped at 1. For display only."""
    need = max((kv_bytes + r.runtime_non_kv_bytes) / r.total_bytes for r in plan.ranks)
    return max(0.0, min(1.0, int(need * 10000) / 10000))


def utilization_kv_bytes(plan: Plan, util: float, rank: int | None = None) -> int:
    """The KV budget a utilisation gives under `plan`'s non-KV estimate: util × total − the
    non-KV memory vLLM subtracts, on `rank` (default: the least of all ranks)."""
    ranks = [r for r in plan.ranks if rank is None or r.rank == rank] or list(plan.ranks)
    return max(0, min(int(util * r.total_bytes) - r.runtime_non_kv_bytes for r in ranks))


def budget_key(spec: ServiceSpec) -> str:
    """Fingerprint (16 hex digits) of every spec field a KV budget depends on. Store it with
    the budget (e.g. a Deployment annotation); when it changes, the budget is re-planned."""
    e, m, r = spec.engine, spec.memory, spec.remediation
    doc = {
        "model": [
            spec.model.name,
            dict(spec.model.shape or {}),
            spec.model.config_map,
            spec.model.config_map_key,
        ]
        + ([spec.model.quantization] if spec.model.quantization else []),
        "split": [spec.tp, spec.pp],
        "engine": [
            e.max_num_seqs,
            e.max_model_len,
            e.max_num_batched_tokens,
            e.dtype,
            e.kv_cache_dtype,
            e.block_size,
            e.enforce_eager,
            e.logits_mode,
            list(e.extra_args),
        ],
        "memory": [
            m.gpu_memory_utilization,
            m.kv_cache_memory_bytes,
            m.safety_margin_bytes,
            m.gpu_memory_bytes,
        ],
        "bounds": [r.min_kv_cache_bytes, r.max_kv_cache_bytes],
    }
    # The engine release's KV facts decide whole blocks and the floor (0.34 counts 64-token
    # blocks): an image moving to a release with other facts re-plans. Keyed only when they
    # differ from the estimate-sizing release's, so services planned before 0.34 keep their key.
    release = engine_release(spec)
    legacy = vllm_snapshots.load(vllm_snapshots.ESTIMATE_SIZING_RELEASE)
    facts = [release.default_block_size, release.null_blocks]
    if facts != [legacy.default_block_size, legacy.null_blocks]:
        doc["release"] = facts
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# vLLM's own default for --gpu-memory-utilization (vllm-memory-facts.md).
VLLM_DEFAULT_UTILIZATION = 0.92
# The utilisation rendered next to a byte budget when no plan knows the GPU: under a byte
# budget it feeds only vLLM's start-up check (free >= total x util), and every card keeps more
# than half free after its CUDA context and NCCL buffers, while a GPU that other processes
# hold more than half of is one vLLM should refuse.
NO_PLAN_STARTUP_UTILIZATION = 0.5


def startup_utilization(
    plan: Plan | None,
    kv_cache_memory_bytes: int,
    startup_free_bytes: int | None = None,
    external_weight_bytes: int | None = None,
) -> float | None:
    """The --gpu-memory-utilization to render NEXT TO a byte budget, from the spec's prior plan.

    vLLM's worker checks `free memory at start-up >= total x gpu_memory_utilization` even when
    --kv-cache-memory-bytes is set (v1 gpu_worker.init_device), with 0.92 by default. After
    CUDA context and NCCL init a small card under TP can have less than 92 % free (4.5 GiB of
    NCCL is 19 % of a 24 GB card), and vLLM then refuses to start although the budget fits.
    The byte budget alone sizes the KV cache, so the utilisation only has to say what vLLM
    will really use: the bottleneck's runtime non-KV memory plus the budget, as a fraction of
    its total, rounded up to 0.001 (82 MB on an 80 GiB card, inside the safety margin), and
    never above vLLM's default. The caller passes the PRIOR plan (`prior_plan`, never one from
    live measurements), so the value changes exactly when the budget or the spec does, and
    never rolls the Deployment by itself. Without a plan (the GPU size is not known yet, the
    model is measured first) nothing says what vLLM will use: `NO_PLAN_STARTUP_UTILIZATION`,
    half the card, rather than vLLM's 0.92, which a small card under tensor parallelism can
    fail after NCCL's buffers (a pinned budget's first start was refused that way). None only
    when the plan says nothing is needed.

    `external_weight_bytes`: weights another process holds on the GPU (a zero-copy weight
    cache), learned from vLLM's "Externally held weights on device ..." refusal. vLLM then checks
    `external < total x util` and `free >= total x util - external` (v1 worker/utils.py
    request_memory), so the free-memory cap moves up by them and the utilisation is kept above
    them (plus the safety margin), even above vLLM's default."""
    if plan is None:
        # weights held outside must stay under total x util: with no total to size it from, vLLM's
        # own default leaves them the most room that the free-memory check allows
        return VLLM_DEFAULT_UTILIZATION if external_weight_bytes else NO_PLAN_STARTUP_UTILIZATION
    needed = max((r.runtime_non_kv_bytes + kv_cache_memory_bytes) / r.total_bytes for r in plan.ranks)
    if needed <= 0:
        return None
    util = min(VLLM_DEFAULT_UTILIZATION, math.ceil(needed * 1000) / 1000)
    external = external_weight_bytes or 0
    if startup_free_bytes is not None:
        # vLLM measured less free memory at a worker's start-up than the priors expect (other
        # CUDA contexts on the GPU, a bigger communicator): stay under what it measured, less
        # the safety margin for run-to-run change. With a byte budget the utilisation feeds
        # nothing but this check (vLLM 0.33 gpu_worker: "does not respect the
        # gpu_memory_utilization config"), so a lower value costs no KV.
        total = min(r.total_bytes for r in plan.ranks)
        share = (startup_free_bytes + external - plan.inputs.safety_margin_bytes) / total
        util = min(util, max(0.001, math.floor(share * 1000) / 1000))
    if external > 0:
        # at or below the weights held outside, vLLM leaves its engine nothing and refuses to start
        total = min(r.total_bytes for r in plan.ranks)
        least = math.ceil((external + plan.inputs.safety_margin_bytes) / total * 1000) / 1000
        util = min(1.0, max(util, least))
    return util


def prior_plan(
    spec: ServiceSpec, learned_gpu_bytes: int | None = None, model: ModelResolution | None = None
) -> Plan | None:
    """The plan from the spec and priors: what rendering sizes its start-up utilisation and
    probe from. One GPU's size is spec.memory.gpuMemoryBytes when set (an override), else the
    size the agents measured once and status keeps (`learned_gpu_bytes`), so nobody has to
    type their GPU's size. None while neither is known; raises SpecError when the spec cannot
    be planned."""
    if model is not None and model.measure_first:
        return None  # nothing to plan from priors: the budget will come from measurement
    return initial_plan(_with_gpu(spec, learned_gpu_bytes), model=model)


def _with_gpu(spec: ServiceSpec, learned_gpu_bytes: int | None) -> ServiceSpec:
    """The spec with the learned GPU size standing in where spec.memory.gpuMemoryBytes is unset."""
    if spec.memory.gpu_memory_bytes is None and learned_gpu_bytes is not None:
        return replace(spec, memory=replace(spec.memory, gpu_memory_bytes=learned_gpu_bytes))
    return spec


def measured_plan(
    spec: ServiceSpec,
    measured: Sequence[RankMeasurement],
    *,
    learned_gpu_bytes: int | None = None,
    model: ModelResolution | None = None,
    slice_bytes: int | None = None,
) -> Plan | None:
    """The plan the policy decides with: the planner's budget for `spec`, with each fresh rank's
    measured total and probe figures (`measured`, observe.headroom.gpu_totals of this pass)
    replacing the priors. None while one GPU's size is unknown (neither measured now, nor learned
    before, nor in the spec). Raises SpecError when the spec cannot be planned. `slice_bytes`: a
    MIG slice's size from the node's labels (budget.gpu_labels), which replaces the agents'
    totals: NVML in the pod may report the parent GPU's."""
    if slice_bytes is not None:
        measured = tuple(replace(m, total_bytes=slice_bytes) for m in measured)
    return initial_plan(_with_gpu(spec, learned_gpu_bytes), measured=measured, model=model)
