"""What the pass plans with: the model as the agents read it, the engine as it reports itself,
the GPU's size, and the measured plan the policy decides with.

The plan is computed here once per pass (the prior plan for rendering, the measured plan for
the policy and status); nothing downstream plans again. A budget no start can have is refused
(core/budget/fits) with a SpecError, as at the start of the pass.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rankguard_operator.core.budget.bounds import measured_plan, prior_plan
from rankguard_operator.core.budget.fits import check_budget_fits, gpu_size
from rankguard_operator.core.budget.gpu_labels import NodeGpu, planning_gpu_bytes, slice_bytes
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.model.resolve import LearnedModel, ModelResolution, learned_from_report, resolve
from rankguard_operator.core.observe.headroom import ReportInput, gpu_totals, learned_gpu_bytes
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.engine import EngineView, engine_view
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step.observed import Observed
from rankguard_operator.core.step.world import World


@dataclass(frozen=True)
class Sized:
    model: ModelResolution
    learned: LearnedModel | None  # what the agents read of the model (status.model)
    prior: Plan | None  # the plan renders start from
    engine: EngineView
    plan: Plan | None  # the measured plan the policy decides with
    gpu_learned: int | None  # one GPU's size, newly measured this pass (status.gpuMemoryBytes)


@dataclass(frozen=True)
class Known:
    """What the pass knew of the model and its plan before this stage."""

    model: ModelResolution
    prior: Plan | None
    node_gpu: NodeGpu | None  # the GPU's size as the nodes' labels state it
    key: str  # the budget key (core/budget/bounds.budget_key)


def size(state: ServiceState, world: World, spec: ServiceSpec, known: Known, seen: Observed) -> Sized:
    """Raises SpecError when what was learned makes the budget impossible."""
    learned, model, prior = _learn_model(state, world, spec, known, seen.reports)
    engine = engine_view(state, spec, seen.observation, known.key, seen.terminations)
    gpu = state.gpu_memory_bytes
    measured = learned_gpu_bytes(
        seen.observation, spec.world_size, [t.total_bytes for t in seen.terminations]
    )
    gpu_learned = None
    if measured is not None and measured != gpu:
        # the GPU's size, measured: from now on the plans (start-up utilisation, probe sizes,
        # the budget itself) stand on it even when the spec does not give it
        gpu = gpu_learned = measured
        prior = prior_plan(spec, planning_gpu_bytes(measured, known.node_gpu), model)
    check_budget_fits(spec, model, gpu_size(spec, gpu, known.node_gpu))
    plan = measured_plan(
        spec,
        gpu_totals(seen.observation, engine.non_kv),
        learned_gpu_bytes=planning_gpu_bytes(gpu, known.node_gpu),
        model=model,
        slice_bytes=slice_bytes(known.node_gpu),
    )
    if model.measure_first and prior is None:
        # no priors to render from: the plan from vLLM's own per-worker report stands in (kept
        # in status.engine per budget key, so it does not move with live load)
        prior = plan
    return Sized(model, learned, prior, engine, plan, gpu_learned)


def _learn_model(
    state: ServiceState, world: World, spec: ServiceSpec, known: Known, reports: Sequence[ReportInput]
) -> tuple[LearnedModel | None, ModelResolution, Plan | None]:
    """What the current pods' agents read of the model (config.json, checkpoint headers), when
    it differs from what status keeps, and the model resolved again with it."""
    have = state.learned_model
    if have is not None and have.name == spec.model.name and have.config and have.checkpoint:
        return have, known.model, known.prior  # read once per model: the files do not change
    for _, report, _ in reports:
        found = report.model
        if found is None:
            continue
        checkpoint = found.checkpoint.to_doc() if found.checkpoint is not None else None
        learned = learned_from_report(found.config, checkpoint, spec.model.name)
        if learned is None or learned == have:
            continue
        model = resolve(spec, world.model_config, learned)
        gpu = planning_gpu_bytes(state.gpu_memory_bytes, known.node_gpu)
        return learned, model, prior_plan(spec, gpu, model)
    return have, known.model, known.prior
