"""Budgets no GPU can run, refused before anything is deployed (DESIGN §7, fail loudly and once).

* `gpu_size`: one GPU's memory as far as anything says (the spec, what the agents measured and
  status keeps, the nodes' GPU Feature Discovery labels), with where it comes from.
* `check_budget_fits`: the spec's budget inputs against that size and against one request of
  maxModelLen (the model's own KV layout): a pinned budget vLLM would refuse at start-up, a
  floor no GPU of this size can hold, or that does not fit beside the least the weights need, a
  safety margin that leaves no room for the floor.
  Raises `SpecError`, so the step refuses the spec (phase Failed, reason InvalidSpec) and
  applies nothing.
* `weights_fit`: after the weights did not load, the split (more TP) or the GPU size whose
  weights and non-KV priors leave the floor, for the Degraded message (core/policy/oom_levers).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from rankguard_operator.core.budget.bounds import engine_block_size, engine_release, plan_input
from rankguard_operator.core.budget.gpu_labels import NodeGpu, planning_gpu_bytes
from rankguard_operator.core.budget.kv_model import resolve_max_model_len, stage_layouts
from rankguard_operator.core.budget.memory_model import PlanError
from rankguard_operator.core.budget.planner import Plan, make_plan
from rankguard_operator.core.model.resolve import ModelResolution
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.spec.crd import MAX_GPUS_PER_REPLICA
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.units import format_bytes

# --------------------------------------------------------------------------------------------
# Budgets no GPU can run


class BudgetDoesNotFit(SpecError):
    """A budget the deployed render cannot run either (its pods crash or never start): a Failed
    service refused for this is scaled to zero at once (core/step/scale_down)."""


def gpu_size(spec: ServiceSpec, learned: int | None, node: NodeGpu | None) -> tuple[int, str] | None:
    """(one GPU's bytes, where that figure comes from), or None while nothing says."""
    if spec.memory.gpu_memory_bytes is not None:
        return spec.memory.gpu_memory_bytes, "spec.memory.gpuMemoryBytes"
    size = planning_gpu_bytes(learned, node)
    if size is None:
        return None
    if node is not None and size == node.bytes:
        return size, f"the GPU Feature Discovery labels of node {node.node or '(unnamed)'}"
    return size, "the agents' measurement (status.gpuMemoryBytes)"


def request_floor(spec: ServiceSpec, model: ModelResolution) -> int | None:
    """The per-GPU KV bytes of one request at maxModelLen plus the block(s) vLLM holds back
    (below it vLLM refuses to start), from the model's KV layout at the block size the image's
    vLLM will use (64 tokens from 0.34, 16 before); None for a model the planner does not model
    (measure-first) or does not know yet."""
    shape = model.plan_shape
    if shape is None:
        return None
    e = spec.engine
    return _request_floor(
        shape,
        spec.tp,
        pp=spec.pp,
        kv_cache_dtype=e.kv_cache_dtype,
        dtype=e.dtype,
        block_size=engine_block_size(spec, shape),
        null_blocks=engine_release(spec).null_blocks,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len,
    )


@functools.lru_cache(maxsize=4096)
def _request_floor(
    shape: ModelShape,
    tp: int,
    *,
    pp: int,
    kv_cache_dtype: str,
    dtype: str,
    block_size: int,
    null_blocks: int,
    max_num_batched_tokens: int,
    max_model_len: int | None,
) -> int | None:
    # Cached like planner.make_plan, on the figures it reads: every pass asks again (twice when
    # it learns the GPU's size), and the layouts cost ~0.25 ms where a hit costs microseconds.
    try:
        layouts = stage_layouts(
            shape,
            tp,
            pp=pp,
            kv_cache_dtype=kv_cache_dtype,
            dtype=dtype,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            null_blocks=null_blocks,
        )
        mml = resolve_max_model_len(shape, max_model_len)
        return max(lay.min_budget_bytes(mml) for lay in layouts)
    except (PlanError, ValueError):
        return None


def _blocks(spec: ServiceSpec, model: ModelResolution) -> str:
    """The block size a floor was counted in, and whose it is (vLLM 0.34 changed it to 64)."""
    shape = model.plan_shape
    assert shape is not None  # a floor exists only for a modelled shape
    size = engine_block_size(spec, shape)
    if spec.engine.block_size:
        return f"{size}-token blocks (spec.engine.blockSize)"
    return f"{size}-token blocks (vLLM {engine_release(spec).version}'s default for this model)"


def check_budget_fits(spec: ServiceSpec, model: ModelResolution, gpu: tuple[int, str] | None) -> None:
    """Raise SpecError when the spec asks for a KV budget no start can have: a pinned budget
    below one request at maxModelLen, or a pinned budget, a floor or one request that does not
    fit in one GPU, or a floor above what the least each rank needs beside its KV cache leaves.
    Only what is certain: the GPU's whole memory and the least a rank needs, not the planner's
    estimate of what it needs (a floor above the estimate starts at the floor, Degraded)."""
    pinned = spec.memory.kv_cache_memory_bytes
    floor = spec.remediation.min_kv_cache_bytes
    one = request_floor(spec, model)
    mml = spec.engine.max_model_len
    request = (
        f"one request of spec.engine.maxModelLen ({mml} tokens)"
        if mml
        else "one request of the model's full context"
    )
    if pinned is not None and one is not None and pinned < one:
        raise BudgetDoesNotFit(
            f"spec.memory.kvCacheMemoryBytes ({pinned} bytes, {format_bytes(pinned)}) cannot hold "
            f"{request}, which needs {one} bytes ({format_bytes(one)}) per GPU in {_blocks(spec, model)}: "
            f"vLLM would refuse to start. Raise it to at least {one}, lower spec.engine.maxModelLen, "
            "or remove it to let rankguard plan the budget"
        )
    if gpu is None:
        return
    size, where = gpu
    gpu_text = f"one GPU's memory ({format_bytes(size)}, from {where})"
    if pinned is not None and pinned >= size:
        raise BudgetDoesNotFit(
            f"spec.memory.kvCacheMemoryBytes ({format_bytes(pinned)}) is not below {gpu_text}: the "
            "KV cache shares each GPU with the weights, activations and NCCL buffers; lower it, or "
            "remove it to let rankguard plan the budget"
        )
    if floor is not None and floor >= size:
        raise BudgetDoesNotFit(
            f"spec.remediation.minKVCacheBytes ({format_bytes(floor)}, the floor of the per-GPU KV "
            f"budget) is not below {gpu_text}, so no budget can satisfy it; lower it well below the "
            "GPU's memory (the weights, activations and NCCL buffers share each GPU), or remove it"
        )
    if one is not None and one >= size:
        raise BudgetDoesNotFit(
            f"{request} needs {format_bytes(one)} of KV cache per GPU, not less than {gpu_text}; "
            "lower spec.engine.maxModelLen, spread the model over more GPUs "
            "(spec.tensorParallelSize, spec.pipelineParallelSize), or set spec.engine.kvCacheDtype: fp8"
        )
    _check_margin(spec, size, gpu_text, floor, one)
    if floor is not None and spec.memory.kv_cache_memory_bytes is None:
        _check_floor_beside_weights(spec, model, size, gpu_text, floor)


def _check_floor_beside_weights(
    spec: ServiceSpec, model: ModelResolution, size: int, gpu_text: str, floor: int
) -> None:
    """A floor above what the least a rank needs beside its KV cache leaves (its weights, the
    smallest non-torch memory a vLLM process was seen to hold, the fp32 logits: the planner's
    feasibility side, never its estimate) cannot start: the first render is the floor, its KV
    allocation runs out of memory on every start, and the service crash-loops until OOMAtFloor.
    Refused before anything is deployed instead. Only with a modelled shape: a measure-first
    model has no weights to count yet."""
    shape = model.plan_shape
    if shape is None:
        return
    try:
        plan = make_plan(plan_input(spec, shape, size, checkpoint=model.checkpoint))
    except PlanError:
        return  # the plan's own refusal is the step's, with its message
    rank = min(plan.ranks, key=lambda r: r.total_bytes - r.least_non_kv_bytes)
    most = rank.total_bytes - rank.least_non_kv_bytes
    if floor > most:
        raise BudgetDoesNotFit(
            f"spec.remediation.minKVCacheBytes ({format_bytes(floor)}, the floor of the per-GPU KV "
            f"budget) does not fit in {gpu_text} beside what rank {rank.rank} needs at the least "
            f"({format_bytes(rank.least_non_kv_bytes)}: its weights, the CUDA context, the logits), "
            f"which leaves at most {format_bytes(max(0, most))}: every start would run out of memory "
            "allocating the KV cache. Lower it below that, spread the model over more GPUs "
            "(spec.tensorParallelSize, spec.pipelineParallelSize), or remove it"
        )


def _check_margin(spec: ServiceSpec, size: int, gpu_text: str, floor: int | None, one: int | None) -> None:
    """The planner keeps spec.memory.safetyMarginBytes free on every GPU and never plans below the
    floor (the larger of minKVCacheBytes and one request): a margin that leaves no room, or no
    room for the floor, would run every pass at the floor and call it Ready."""
    margin = spec.memory.safety_margin_bytes
    if margin >= size:
        raise BudgetDoesNotFit(
            f"spec.memory.safetyMarginBytes ({format_bytes(margin)}, {margin} bytes) is not below "
            f"{gpu_text}: the planner would keep the whole GPU free; lower it (the default is "
            "512Mi, for transient peaks)"
        )
    if spec.memory.kv_cache_memory_bytes is not None:
        return  # a pinned budget is not planned down to a floor
    least = max((b for b in (floor, one) if b is not None), default=None)
    if least is not None and margin + least >= size:
        said = "spec.remediation.minKVCacheBytes" if least == floor else "one request of maxModelLen"
        raise BudgetDoesNotFit(
            f"spec.memory.safetyMarginBytes ({format_bytes(margin)}) and the smallest KV budget "
            f"rankguard runs ({format_bytes(least)}, {said}) do not fit together in {gpu_text}: "
            "every plan would end at the floor. Lower spec.memory.safetyMarginBytes (default 512Mi) "
            "or the floor"
        )


# --------------------------------------------------------------------------------------------
# After the weights did not load


@dataclass(frozen=True)
class WeightsFit:
    """What the planner says would hold the model, after its weights did not load.

    tp: the smallest tensor-parallel size above the current one (same pipeline stages, same
        GPU) whose every rank keeps room for the floor (one request of maxModelLen) and the
        safety margin next to its weights and non-KV priors; None when none up to
        MAX_GPUS_PER_REPLICA does (or the model's heads allow none).
    gpu_bytes: one GPU's memory that would hold the current split: the largest rank's non-KV
        estimate plus the floor and the margin, and at least the GPU that just failed plus the
        allocation's deficit and the margin when the message gave one; None when the priors say
        the current GPU holds it and the message gave no figures (only "a larger GPU" is known).
    """

    tp: int | None
    gpu_bytes: int | None


def weights_fit(plan: Plan, deficit_bytes: int | None = None) -> WeightsFit | None:
    """The split or GPU size that would fit the model (see WeightsFit); None for a plan made
    from measurements alone (a measure-first model: no priors say what its weights need).

    Other tensor-parallel sizes are planned from priors (config.json arithmetic): this run's
    measurements and checkpoint headers are per rank of the current split."""
    inp = plan.inputs
    if inp.measured_only:
        return None
    need: int | None = (
        max(r.non_kv_bytes for r in plan.ranks) + inp.safety_margin_bytes + plan.min_kv_cache_memory_bytes
    )
    total = min(r.total_bytes for r in plan.ranks)
    if deficit_bytes is not None:
        need = max(need or 0, total + deficit_bytes + inp.safety_margin_bytes)
    elif need is not None and need <= total:
        need = None  # the priors thought it fits: they are wrong, by how much nothing says
    prior = replace(inp, measured=(), checkpoint_weights=None)
    for tp in range(inp.tp + 1, MAX_GPUS_PER_REPLICA // inp.pp + 1):
        try:
            if make_plan(replace(prior, tp=tp)).feasible:
                return WeightsFit(tp=tp, gpu_bytes=need)
        except PlanError:
            continue  # this TP does not divide the heads: vLLM would refuse it
    return WeightsFit(tp=None, gpu_bytes=need)
