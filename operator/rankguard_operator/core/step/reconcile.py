"""One reconcile step of an LLMService, as a pure function: `step(state, world, settings) -> Step`,
read as its stages.

`state` is what `.status` carries from one pass to the next (typed: `ServiceState`); `world` is
what the edge observed for this pass (the spec, the Deployment, the pods, the agents' reports,
the clock, and the id a new remediation would carry). The stages, each a module of this room
taking and returning plain values:

    gather    what the pass must read, from the spec parsed once     (the edge calls it first)
    trust     which pods the pass listens to                         (the edge calls it first)
    refuse    a spec or surroundings the step cannot serve           refusals, surroundings
    pending   finish what a previous pass decided, exactly once      pending
    observe   reports, terminations, rollout, clocks, blockers        observed
    size      the model, the engine, the GPU and the measured plan    sizing
    decide    the policy's verdict, and the roll it makes             decide
    keep      the workload and its Service as rendered                keep
    report    the status, the conditions, the Events; the Step        report

The result is the next state and the effects, as values, in the order the edge must carry
them out:

    ApplyClaim -> WriteIntent -> ApplyDeployment | ApplyObject | DeleteObject -> PostEvent
               -> ApplyService -> WriteStatus

Restart safety is a property of this order and of `step` reading only persisted state: a
remediation writes its intent (`status.pendingRemediation`, with the history record) before the
roll, the roll stamps the intent's id on the Deployment, and a later step that finds the intent
rolls only when the Deployment does not carry that id (core/step/pending). Terminations are
deduplicated by pod uid / container / run number in `status.handledTerminations`.

Pure: no I/O, no clock (`world.now`), deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rankguard_operator.core.budget.bounds import budget_key, prior_plan
from rankguard_operator.core.budget.fits import BudgetDoesNotFit, check_budget_fits, gpu_size
from rankguard_operator.core.budget.gpu_labels import planning_gpu_bytes
from rankguard_operator.core.effects import Effect
from rankguard_operator.core.model.resolve import resolve
from rankguard_operator.core.observe.groups import Groups, group_view, live_groups
from rankguard_operator.core.observe.pods import deployment_template_hash
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.status.scale import scaled_only
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.status.sizing import sizing_status
from rankguard_operator.core.step import surroundings
from rankguard_operator.core.step.decide import Acted, act, decide, located
from rankguard_operator.core.step.keep import Kept, keep
from rankguard_operator.core.step.observed import observe
from rankguard_operator.core.step.pending import Finished, finish_pending
from rankguard_operator.core.step.refusals import invalid_spec
from rankguard_operator.core.step.rendering import Live, Renderer
from rankguard_operator.core.step.report import Findings, report
from rankguard_operator.core.step.sizing import Known, Sized, size
from rankguard_operator.core.step.world import Settings, Step, World, merge_keys


def step(
    state: ServiceState, world: World, settings: Settings, spec: ServiceSpec | SpecError | None = None
) -> Step:
    """One pass. `spec`: the spec as core/step/gather parsed it for this pass (or why it could
    not); parsed here when not given."""
    try:
        spec = _parsed(world, spec)
        # a name an older LLMService holds, or another's cache claim: nothing is applied
        refused = surroundings.refusal(world, spec)
        if refused is not None:
            return invalid_spec(
                state, world, refused.message, refused.reason, refused.conditions, stop=refused.stop
            )
        known = _known(state, world, spec)
    except SpecError as e:
        return _refused(state, world, e)
    return _serve(state, world, settings, spec, known)


def _refused(state: ServiceState, world: World, e: SpecError) -> Step:
    """A spec the step cannot serve, found before or after what this pass learned; a budget no
    start can have says the deployed render cannot run either (core/budget/fits)."""
    return invalid_spec(state, world, str(e), cannot_run=isinstance(e, BudgetDoesNotFit))


def _parsed(world: World, spec: ServiceSpec | SpecError | None) -> ServiceSpec:
    if isinstance(spec, SpecError):
        raise spec
    return parse_spec(world.spec) if spec is None else spec


def _known(state: ServiceState, world: World, spec: ServiceSpec) -> Known:
    """The model and the prior plan, before anything of this pass is observed. Raises SpecError
    for a budget no start can have (core/budget/fits), before anything is deployed."""
    model = resolve(spec, world.model_config, state.learned_model)
    node_gpu = surroundings.node_gpu(world, spec, state.node_gpu)  # as the nodes' labels state it
    check_budget_fits(spec, model, gpu_size(spec, state.gpu_memory_bytes, node_gpu))
    prior = prior_plan(spec, planning_gpu_bytes(state.gpu_memory_bytes, node_gpu), model)
    return Known(model, prior, node_gpu, budget_key(spec))


@dataclass(frozen=True)
class _Workload:
    live: Live
    groups: Groups | None  # a multi-node service's groups (spec.distributed)


def _workload(world: World, spec: ServiceSpec) -> _Workload:
    """The Deployment, or for a multi-node service a Deployment-shaped view of its groups."""
    if spec.distributed is None:
        return _Workload(Live(world.deployment), None)
    groups = live_groups(world.statefulsets, world.pods, spec.distributed.pods_per_group)
    return _Workload(Live(group_view(groups, spec.replicas)), groups)


def _serve(state: ServiceState, world: World, settings: Settings, spec: ServiceSpec, known: Known) -> Step:
    first_pass = not state.service_applied
    # this generation changed spec.replicas alone (core/status/scale): a scale, no edit
    scaled = scaled_only(state.raw, world.generation, world.spec)
    effects: list[Effect] = list(
        surroundings.claim_effects(
            world,
            spec,
            first_pass=first_pass,
            observed_generation=state.observed_generation,
            scaled=scaled,
        )
    )
    _, startup_free, external_weights = state.kept_engine(known.key)
    renderer = Renderer(
        world, spec, settings.agent_image, known.prior, startup_free, external_weights, known.model.spec_shape
    )
    workload = _workload(world, spec)
    done = finish_pending(state, workload.live, renderer)
    effects += done.effects
    current_hash = deployment_template_hash(renderer.render(done.current)) if done.current else None
    seen = observe(
        state,
        world,
        spec,
        settings,
        current_hash=current_hash,
        handled=done.handled,
        deployment=done.live.deployment,
    )
    try:
        sized = size(state, world, spec, known, seen, current=done.current)
    except SpecError as e:
        return _refused(state, world, e)
    # what this pass learned renders from here on: the plan, the engine's start-up, the model
    renderer = replace(
        renderer,
        prior=sized.prior,
        startup_free=sized.engine.startup_free_bytes,
        external_weights=sized.engine.external_weight_bytes,
        shape=sized.model.spec_shape,
    )
    decision = decide(
        state, spec, world.now, current=done.current, seen=seen, sized=sized, history=done.history
    )
    acted = act(
        decision,
        world.now,
        world.new_id,
        renderer=renderer,
        live=done.live,
        current=done.current,
        history=done.history,
        where=located(decision, seen, workload.groups),
    )
    effects += acted.effects
    assert acted.current is not None  # the first pass takes the decision's flags
    kept = keep(
        state,
        world,
        renderer=renderer,
        current=acted.current,
        live=acted.live,
        groups=workload.groups,
        first_pass=first_pass,
        scaled=scaled,
    )
    effects += kept.effects
    # the status as stored at this point of the pass: the intent written changes it
    stored = dict(state.raw) if acted.intent is None else {**state.raw, "pendingRemediation": acted.intent}
    found = Findings(
        spec=spec,
        model=sized.model,
        learned=sized.learned,
        prior=sized.prior,
        plan=sized.plan,
        engine=sized.engine,
        key=known.key,
        decision=decision,
        current=acted.current,
        history=acted.history,
        handled=merge_keys(done.handled, decision.handled),
        seen=seen,
        rollout=kept.rollout,
        deployment=kept.live.deployment,
        new_revision=acted.new_revision,
        scaling=kept.scaling,
        scaled=scaled,
        updates=_updates(done, sized, acted, kept) | _node_gpu(state, known),
        members=kept.members,
        groups=workload.groups,
    )
    return report(state, world, settings, found, stored=stored, effects=effects)


def _node_gpu(state: ServiceState, known: Known) -> dict[str, Any]:
    """status.nodeGpu, when the nodes' labels said something new: kept so that a render never
    changes because no pod runs (surroundings.node_gpu)."""
    if known.node_gpu is None or known.node_gpu == state.node_gpu:
        return {}
    return {"nodeGpu": known.node_gpu.to_status()}


def _updates(done: Finished, sized: Sized, acted: Acted, kept: Kept) -> dict[str, Any]:
    """The status fields the stages set: a finished intent cleared, a GPU size learned, the
    LeaderWorkerSet's render applied."""
    updates: dict[str, Any] = {}
    if done.cleared or acted.intent is not None:
        updates["pendingRemediation"] = None
    if sized.gpu_learned is not None:
        updates["gpuMemoryBytes"] = sized.gpu_learned
    if kept.workload_hash is not None:
        updates["workloadHash"] = kept.workload_hash
    elif kept.forget_workload:
        updates["workloadHash"] = None
    updates["sizing"] = sizing_status(sized.mode, sized.outside, acted.current)
    return updates
