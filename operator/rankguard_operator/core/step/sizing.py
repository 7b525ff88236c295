"""What the pass plans with: the model as the agents read it, the engine as it reports itself,
the GPU's size, the measured plan the policy decides with, and who sizes the KV cache (vLLM 0.34
measures its own after warm-up: core/engine/sizing_mode) with what the engine cannot see.

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
from rankguard_operator.core.engine.rules import rules_for
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import ModeFacts, SizingMode, sizing_mode
from rankguard_operator.core.model.resolve import LearnedModel, ModelResolution, learned_from_report, resolve
from rankguard_operator.core.observe.headroom import ReportInput, gpu_totals, learned_gpu_bytes
from rankguard_operator.core.observe.outside_memory import Outside, kept, outside
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
    mode: SizingMode  # who sizes the KV cache (status.sizing)
    outside: Outside  # what the engine cannot see, and what it said of its measurement


@dataclass(frozen=True)
class Known:
    """What the pass knew of the model and its plan before this stage."""

    model: ModelResolution
    prior: Plan | None
    node_gpu: NodeGpu | None  # the GPU's size as the nodes' labels state it
    key: str  # the budget key (core/budget/bounds.budget_key)


def size(
    state: ServiceState,
    world: World,
    spec: ServiceSpec,
    known: Known,
    seen: Observed,
    *,
    current: ServingFlags | None,
) -> Sized:
    """Raises SpecError when what was learned makes the budget impossible. `current`: the flags
    in effect (a budget rankguard pinned after OOMs keeps the mode pinned)."""
    learned, model, prior = _learn_model(state, world, spec, known, seen.reports)
    engine = engine_view(state, spec, seen.observation, known.key, seen.terminations)
    found = outside(seen.reports, kept(state.raw.get("sizing")))
    mode = _mode(spec, engine.version, found, current)
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
    return Sized(model, learned, prior, engine, plan, gpu_learned, mode, found)


def _mode(spec: ServiceSpec, version: str | None, found: Outside, current: ServingFlags | None) -> SizingMode:
    """The mode by the rules of the engine that runs (or the image's tag before one reports)."""
    rules = rules_for(version)
    return sizing_mode(
        pinned_by_user=spec.memory.pinned,
        extra_args=spec.engine.extra_args,
        cli=rules.cli,
        facts=ModeFacts(
            version=rules.version,
            extensible=rules.snapshot.engine.get("extensible_kv_cache"),
            vmm=found.vmm,
            imex_channel=found.imex_channel,
            engine_disabled=found.engine_disabled,
            fallen_back=current is not None and current.pinned_after_ooms,
        ),
    )


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
