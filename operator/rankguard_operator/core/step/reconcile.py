"""One reconcile step of an LLMService, as a pure function: `step(state, world) -> Step`.

(Over 450 lines because the step is one pass read top to bottom, single-pod and multi-node
alike; what each stage calls lives in the rooms below it.)

(The step reads as the loop does, top to bottom, in one place; its inputs and outputs live in
`step.world`, its state in `status.service_state`, its effects in `effects`, the pod-shaped
conditions in `step.surroundings`, what the pods show that no decision answers in
`observe.blockers` and `observe.pod_blockers`, the budgets no GPU can run in `budget.fits`,
the Failed service's scale to zero in `step.scale_down`, and the one Event per change of
Degraded in `status.degraded`.)

`state` is what `.status` carries from one pass to the next (typed: `ServiceState`); `world`
is what the edge observed for this pass (the spec, the Deployment, the pods, the agents'
reports, the clock, and the id a new remediation would carry). The result is the next state
and the effects, as values, in the order the edge must carry them out:

    ApplyClaim -> WriteIntent -> ApplyDeployment -> PostEvent -> ApplyService -> WriteStatus

Restart safety is a property of this order and of `step` reading only persisted state: a
remediation writes its intent (`status.pendingRemediation`, with the history record) before
the roll, the roll stamps the intent's id on the Deployment, and a later step that finds the
intent rolls only when the Deployment does not carry that id, then records the history entry
if the dead pass had not. The remediation's Event is named after the id, so posting it again
after a restart is a no-op. Terminations are deduplicated by pod uid / container / run number
in `status.handledTerminations`.

The plan is computed here once per step (the spec's prior plan for rendering, the measured
plan for the policy and status); nothing downstream plans again.

Pure: no I/O, no clock (`world.now`), deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from rankguard_operator.core import policy
from rankguard_operator.core.budget.bounds import budget_key, measured_plan, prior_plan
from rankguard_operator.core.budget.fits import BudgetDoesNotFit, check_budget_fits, gpu_size
from rankguard_operator.core.budget.gpu_labels import NodeGpu, planning_gpu_bytes, slice_bytes
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.conditions import Condition, Phase, set_condition
from rankguard_operator.core.effects import (
    ApplyDeployment,
    ApplyObject,
    ApplyService,
    DeleteObject,
    Effect,
    PostEvent,
    WriteIntent,
    WriteStatus,
)
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.resolve import ModelResolution, learned_from_report, model_event, resolve
from rankguard_operator.core.names import REMEDIATION_ID_ANNOTATION
from rankguard_operator.core.observe import blockers, memory_trend, pod_blockers, pods
from rankguard_operator.core.observe.groups import group_view, live_groups
from rankguard_operator.core.observe.headroom import aggregate, gpu_totals, learned_gpu_bytes
from rankguard_operator.core.policy.history import history_from_status
from rankguard_operator.core.render.deployment import render_deployment, render_service
from rankguard_operator.core.render.group import (
    GROUP_SET_KIND,
    GroupInputs,
    render_group_service,
    render_group_set,
)
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.status.build import append_history, build_status
from rankguard_operator.core.status.creep import creep_event
from rankguard_operator.core.status.degraded import degraded_event, said_before
from rankguard_operator.core.status.engine import engine_status, engine_view, with_rules_condition
from rankguard_operator.core.status.patch import merged_status, status_patch
from rankguard_operator.core.status.service_state import PendingRemediation, ServiceState
from rankguard_operator.core.step import group_roll, scale_down, surroundings
from rankguard_operator.core.step.world import (
    ReportInput,
    Settings,
    Step,
    World,
    after_apply,
    merge_keys,
    remediation_id_of,
    same_template,
)
from rankguard_operator.core.units import iso, iso_or_none

# --------------------------------------------------------------------------------------------
# The step


def step(state: ServiceState, world: World, settings: Settings) -> Step:
    """One pass: finish a pending remediation, observe, decide, act, report."""
    try:
        spec = parse_spec(world.spec)
        # a name an older LLMService holds, or another's cache claim: nothing is applied
        refused = surroundings.refusal(world, spec)
        if refused is not None:
            return invalid_spec(state, world, refused.message, refused.reason, refused.conditions)
        model = resolve(spec, world.model_config, state.learned_model)
        node_gpu = surroundings.node_gpu(world, spec)  # the GPU's size as the nodes' labels state it
        # a budget no start can have is refused before anything is deployed (core/budget/fits)
        check_budget_fits(spec, model, gpu_size(spec, state.gpu_memory_bytes, node_gpu))
        prior = prior_plan(spec, planning_gpu_bytes(state.gpu_memory_bytes, node_gpu), model)
    except SpecError as e:
        return invalid_spec(state, world, str(e), cannot_run=isinstance(e, BudgetDoesNotFit))
    return _Pass(state, world, settings, spec, prior, model, node_gpu=node_gpu).run()


class _Pass:
    """The working variables of one step, so the step reads top to bottom as the loop does."""

    def __init__(  # noqa: PLR0917 - the step's inputs, as `step` has them
        self,
        state: ServiceState,
        world: World,
        settings: Settings,
        spec: ServiceSpec,
        prior: Plan | None,
        model: ModelResolution,
        *,
        node_gpu: NodeGpu | None,
    ) -> None:
        self.state, self.world, self.settings, self.spec, self.prior = state, world, settings, spec, prior
        self.model, self.learned = model, state.learned_model
        self.effects: list[Effect] = []
        self.deployment = world.deployment
        # a multi-node service (spec.distributed): its groups, and a Deployment-shaped view of them
        self.groups = None
        self.roll_annotations: dict[str, str] = {}
        if spec.distributed is not None:
            self.groups = live_groups(world.statefulsets, world.pods, spec.distributed.pods_per_group)
            self.deployment = group_view(self.groups, spec.replicas)
        self.current = state.serving_flags
        self.handled = state.handled
        self.history: list[dict[str, Any]] = [dict(h) for h in state.history]
        self.updates: dict[str, Any] = {}
        # The status as stored at this point of the step (the intent changes it mid-step); the
        # final patch is computed against this, so it also clears the intent it follows.
        self.stored: dict[str, Any] = dict(state.raw)
        # what the last pass rendered with; this pass's engine view may lower it
        self.key = budget_key(spec)
        _, self.startup_free, self.external_weights = state.kept_engine(self.key)
        self.node_gpu = node_gpu
        self.members: dict[str, Any] | None = None  # status.groups, when multi-node

    def gpu(self, learned: int | None) -> int | None:
        """One GPU's size for the plans: the agents' figure or the nodes' labels (core/budget/gpu_labels)."""
        return planning_gpu_bytes(learned, self.node_gpu)

    def render(self, flags: ServingFlags, remediation_id: str | None = None) -> dict[str, Any]:
        w = self.world
        if self.spec.distributed is not None:
            return render_group_set(
                w.name,
                w.namespace,
                w.uid,
                GroupInputs(
                    self.spec,
                    flags,
                    self.settings.agent_image,
                    self.prior,
                    startup_free_bytes=self.startup_free,
                    external_weight_bytes=self.external_weights,
                    shape=self.model.spec_shape,
                ),
                revision_annotations={REMEDIATION_ID_ANNOTATION: remediation_id} if remediation_id else None,
            )
        return render_deployment(
            w.name,
            w.namespace,
            w.uid,
            self.spec,
            flags,
            agent_image=self.settings.agent_image,
            plan=self.prior,
            revision_annotations={REMEDIATION_ID_ANNOTATION: remediation_id} if remediation_id else None,
            startup_free_bytes=self.startup_free,
            external_weight_bytes=self.external_weights,
            shape=self.model.spec_shape,
        )

    def learn_model(self, reports: Sequence[ReportInput]) -> None:
        """Take what the current pods' agents read of the model (config.json, checkpoint headers)
        when it differs from what status keeps, and resolve the model again with it."""
        have = self.learned
        if have is not None and have.name == self.spec.model.name and have.config and have.checkpoint:
            return  # read once per model: the agent reads its files once, so nothing new comes
        for _, report, _ in reports:
            found = report.model
            if found is None:
                continue
            learned = learned_from_report(
                found.config,
                found.checkpoint.to_doc() if found.checkpoint is not None else None,
                self.spec.model.name,
            )
            if learned is None or learned == self.learned:
                continue
            self.learned = learned
            self.model = resolve(self.spec, self.world.model_config, learned)
            self.prior = prior_plan(self.spec, self.gpu(self.state.gpu_memory_bytes), self.model)
            return

    def apply(self, body: dict[str, Any], **kw: Any) -> None:
        if body.get("kind") == GROUP_SET_KIND:
            # a group set is applied group by group in 4. (core/step/group_roll); a remediation's
            # id goes on the sets that roll for it
            self.roll_annotations = dict((body.get("metadata") or {}).get("annotations") or {})
        else:
            self.effects.append(ApplyDeployment(body, **kw))
        self.deployment = after_apply(self.deployment, body)
        if body.get("kind") == GROUP_SET_KIND:
            # no controller stands between rankguard and the groups' view: nothing to observe
            self.deployment["status"]["observedGeneration"] = self.deployment["metadata"]["generation"]

    # 1. ------------------------------------------------------------------------------------
    def finish_pending(self) -> None:
        """Finish what a previous pass decided (maybe before a restart): exactly once."""
        pending = self.state.pending
        if pending is None:
            return
        target = pending.to_flags
        if target is not None and remediation_id_of(self.deployment) != pending.id:
            self.apply(self.render(target, pending.id))
        record = pending.record
        if record is not None and not any(h.get("revision") == pending.id for h in self.history):
            # The pass that decided this died before writing its history: write it now. Its
            # Event is named after the id, so it is posted once whoever gets there first.
            self.history = append_history(self.history, record)
            self.effects.append(
                PostEvent(
                    "Warning",
                    "RemediationResumed",
                    str(record.get("message") or ""),
                    name=pending.id,
                )
            )
        self.current = target or self.current
        self.handled = merge_keys(self.handled, pending.terminations)
        self.updates["pendingRemediation"] = None

    # 4. (multi-node) ------------------------------------------------------------------------
    def roll_groups(self, want: dict[str, Any]) -> None:
        """Move the groups one pass toward `want` (core/step/group_roll); drop the single-pod
        Deployment of a service that became multi-node."""
        w = self.world
        assert self.groups is not None
        if w.deployment is not None:
            self.effects.append(DeleteObject("Deployment", w.name, w.namespace))
        lws = want.get("leaderWorkerSet")
        if lws is not None:
            # LWS's controller rolls and restarts the groups; rankguard applies when its render changed
            digest = pods.deployment_template_hash(want)
            if self.state.raw.get("workloadHash") != digest or self.roll_annotations:
                self.effects.append(ApplyObject(lws))
                self.updates["workloadHash"] = digest
            return
        recorded = self.state.raw.get("groups")
        annotated = {**want, "metadata": {**want["metadata"], "annotations": self.roll_annotations}}
        plan = group_roll.plan_roll(
            annotated, self.groups, recorded if isinstance(recorded, dict) else {}, namespace=w.namespace
        )
        self.effects += plan.effects
        self.members = plan.members

    # 2-5. ----------------------------------------------------------------------------------
    def run(self) -> Step:
        w, spec, state = self.world, self.spec, self.state
        first = not state.service_applied
        self.effects += surroundings.claim_effects(
            w, spec, first_pass=first, observed_generation=state.observed_generation
        )
        self.finish_pending()

        # 2. Observe. Only pods of the template in effect speak for the current flags.
        current_hash = pods.deployment_template_hash(self.render(self.current)) if self.current else None
        pods_now = {
            str(p["metadata"]["name"])
            for p in w.pods
            if pods.pod_ready(p) and pods.carried_template_hash(p) == current_hash
        }
        reports = [r for r in w.reports if r[0] in pods_now]
        observation = aggregate(reports, w.now, self.settings.stale_after)
        fresh_terms = pods.new_terminations(w.pods, set(self.handled))
        rollout = pods.rollout_state(self.deployment, current_hash or "") if self.deployment else None
        low_since = policy.track_low_headroom(state.low_headroom_since, observation, spec, w.now)
        ample_since = policy.track_ample_headroom(state.ample_headroom_since, observation, spec, w.now)
        ample_lowest = policy.track_ample_lowest(
            state.ample_headroom_lowest, state.ample_headroom_since, ample_since, observation
        )
        # the tightest rank's headroom over hours, for the MemoryCreep condition only (the policy
        # never reads it); any vLLM run that ended starts it over
        trend = memory_trend.track(
            state.memory_trend,
            observation,
            key=memory_trend.serving_key(w.pods, current_hash),
            now=w.now,
            restarted=bool(fresh_terms),
        )
        unscheduled = blockers.unschedulable(
            w.pods,
            state.unschedulable_since,
            w.now,
            gpus=spec.gpus_per_pod,
            gpu_resource=spec.resources.gpu_resource_name,
        )
        stuck = pod_blockers.pod_blockers(
            w.pods,
            state.stuck_since,
            w.now,
            deployment=w.deployment if spec.distributed is None else None,
            statefulsets=w.statefulsets,
            events=w.events,
        )
        try:
            self.learn_model(reports)
            engine = engine_view(state, spec, observation, self.key, fresh_terms)
            self.startup_free = engine.startup_free_bytes
            self.external_weights = engine.external_weight_bytes
            gpu = state.gpu_memory_bytes
            learned = learned_gpu_bytes(observation, spec.world_size, [t.total_bytes for t in fresh_terms])
            if learned is not None and learned != gpu:
                # the GPU's size, measured: from now on the plans (start-up utilisation, probe
                # sizes, the budget itself) stand on it even when the spec does not give it
                gpu = self.updates["gpuMemoryBytes"] = learned
                self.prior = prior_plan(spec, self.gpu(learned), self.model)
            check_budget_fits(spec, self.model, gpu_size(spec, gpu, self.node_gpu))
            plan = measured_plan(
                spec,
                gpu_totals(observation, engine.non_kv),
                learned_gpu_bytes=self.gpu(gpu),
                model=self.model,
                slice_bytes=slice_bytes(self.node_gpu),
            )
            if self.model.measure_first and self.prior is None:
                # no priors to render from: the plan from vLLM's own per-worker report stands in
                # (kept in status.engine per budget key, so it does not move with live load)
                self.prior = plan
        except SpecError as e:
            return invalid_spec(state, w, str(e), cannot_run=isinstance(e, BudgetDoesNotFit))
        decision = policy.decide(
            policy.PolicyInput(
                spec=spec,
                now=w.now,
                current=self.current,
                last_known_good=state.last_known_good,
                observation=observation,
                new_terminations=fresh_terms,
                rollout=rollout,
                history=history_from_status(self.history),
                plan=plan,
                low_headroom_since=low_since,
                ample_headroom_since=ample_since,
                ample_headroom_lowest=ample_lowest,
                budget_key=state.budget_key if self.current is not None else None,
            )
        )
        self.handled = merge_keys(self.handled, decision.handled)

        # 3. Act.
        if self.current is None:
            self.current = decision.flags  # the first render: nothing to roll back from
            self.effects.append(PostEvent("Normal", decision.reason, decision.message, repeat=True))
        elif decision.changes_flags:
            rid = w.new_id
            record = decision.remediation(w.now, revision=rid) if decision.is_remediation else None
            intent = PendingRemediation(
                id=rid,
                kind=decision.action,
                started_at=iso(w.now),
                from_flags=self.current,
                to_flags=decision.flags,
                terminations=decision.handled,
                record=None if record is None else record.to_status(),
            )
            # The intent first: a crash between here and the roll is finished by the next step.
            self.effects.append(WriteIntent(intent.to_status()))
            self.stored["pendingRemediation"] = intent.to_status()
            self.apply(
                self.render(decision.flags, rid),
                remediation_id=rid if record is not None else None,
                action=decision.action,
                trigger=decision.trigger,
            )
            if record is not None:
                self.history = append_history(self.history, record)
            kind: Literal["Normal", "Warning"] = (
                "Normal" if decision.action in ("grow", "replan") else "Warning"
            )
            self.effects.append(PostEvent(kind, decision.reason, decision.message, name=rid))
            self.current = decision.flags
            self.updates["pendingRemediation"] = None
            low_since, ample_since = None, None  # a new revision starts its own headroom clocks
        elif decision.action == "none" and decision.trigger in policy.CRASH_TRIGGERS and decision.message:
            # a crash answered without a change of flags (e.g. a start-up check refusal: the
            # render changes instead); say so once per termination
            self.effects.append(PostEvent("Warning", decision.reason, decision.message, repeat=True))
        # ("degrade" and "hold" are said once per change of the Degraded condition, in 5.)

        # 4. Keep the Deployment and Service as rendered. Server-side apply is idempotent; it is
        #    skipped when the live template already carries what we would render.
        want = self.render(self.current)
        if not same_template(self.deployment, want, spec.replicas):
            self.apply(want)
        if spec.distributed is not None:
            self.roll_groups(want)
        elif w.statefulsets:
            # the service stopped being multi-node: its groups go (the Deployment replaces them)
            self.effects += [
                DeleteObject("StatefulSet", str(s["metadata"]["name"]), w.namespace) for s in w.statefulsets
            ]
        rollout = pods.rollout_state(self.deployment, pods.deployment_template_hash(want) or "")
        if first or w.generation != state.observed_generation:
            self.effects.append(ApplyService(render_service(w.name, w.namespace, w.uid, spec)))
            if spec.distributed is not None and spec.distributed.workload == "StatefulSet":
                self.effects.append(ApplyObject(render_group_service(w.name, w.namespace, w.uid)))

        # 5. Report (written only when something changed).
        ready = int(((self.deployment or {}).get("status") or {}).get("readyReplicas") or 0)
        lkg = policy.next_last_known_good(
            state.last_known_good,
            self.current,
            spec=spec,
            rollout=rollout,
            observation=observation,
            terminations=fresh_terms,
        )
        new_status = build_status(
            old=state.raw,
            spec=spec,
            generation=w.generation,
            now_iso=iso(w.now),
            observation=observation,
            flags=self.current,
            last_known_good=lkg,
            plan=plan,
            prior=self.prior,
            decision=decision,
            rollout=rollout,
            ready_replicas=ready,
            history=self.history,
            blocker=unscheduled.blocker or stuck.blocker,
            memory_trend=trend,
        )
        new_status.update(self.updates)
        if self.members is not None:
            new_status["groups"] = self.members
        new_status["conditions"] = with_rules_condition(
            new_status["conditions"], engine, iso(w.now), w.generation
        )
        new_status["conditions"] = set_condition(
            new_status["conditions"],
            Condition.MODEL_RESOLVED,
            *self.model.condition(),
            iso(w.now),
            w.generation,
        )
        new_status["model"] = self.model.to_status(self.learned)
        event = model_event(state.raw.get("model"), self.model)
        if event is not None:
            self.effects.append(PostEvent(*event, repeat=True))
        settled = surroundings.settle(
            new_status["conditions"],
            w,
            spec,
            current_hash=current_hash,
            observation=observation,
            reported_pods=[r[0] for r in reports],
            now_iso=iso(w.now),
            unavailable_after=self.settings.agent_unavailable_after,
        )
        new_status["conditions"] = settled.conditions
        self.effects += settled.events
        said = degraded_event(
            state.raw.get("conditions") or [],
            new_status["conditions"],
            posted=[e.reason for e in self.effects if isinstance(e, PostEvent)],
        )
        if said is not None:
            self.effects.append(said)
        creep = creep_event(state.raw.get("conditions") or [], new_status["conditions"])
        if creep is not None:
            self.effects.append(creep)
        new_status.update(
            {
                "servingFlags": self.current.to_status(),
                "engine": engine_status(engine, self.key),
                "budgetKey": self.key,
                "handledTerminations": list(self.handled),
                "lowHeadroomSince": iso_or_none(low_since),
                "ampleHeadroomSince": iso_or_none(ample_since),
                "ampleHeadroomLowestBytes": ample_lowest,
                "unschedulableSince": iso_or_none(unscheduled.since),
                "stuckSince": iso_or_none(stuck.since),
                "serviceApplied": True,
            }
        )
        patch = status_patch(self.stored, new_status)
        if patch is not None:
            self.effects.append(WriteStatus(patch))
        next_state = ServiceState.from_status(merged_status(self.stored, new_status))
        phase = str(new_status.get("phase") or "")
        return Step(
            next_state,
            tuple(self.effects),
            decision,
            phase,
            settled.agents_unavailable,
            pass_again_after=min(
                (
                    t
                    for t in (
                        unscheduled.due_in,
                        stuck.due_in,
                        policy.headroom_due_in(low_since, ample_since, w.now),
                    )
                    if t is not None
                ),
                default=None,
            ),
            spec=spec,
            terminations=tuple(fresh_terms),
        )


def invalid_spec(
    state: ServiceState,
    world: World,
    message: str,
    reason: str = "InvalidSpec",
    more: Sequence[tuple[Condition, str, str, str]] = (),
    *,
    cannot_run: bool = False,
) -> Step:
    """A spec rankguard cannot serve (or a refusal of `reason`, setting the conditions in `more`
    too): say why on the object, and touch nothing else but the scale of a workload none of
    whose pods serves nor will (core/step/scale_down: a Failed service holds no GPUs);
    `cannot_run`: the refusal says the deployed render cannot run either (budget.fits)."""
    when = iso(world.now)
    scaled, said = scale_down.hold_nothing(
        world.deployment, world.statefulsets, world.uid, world.pods, cannot_run=cannot_run
    )
    message = f"{message.rstrip('.')}. {said}" if said else message
    conditions = list(state.raw.get("conditions") or [])
    for cond, status, why, text in (
        (Condition.DEGRADED, "True", reason, message),
        (Condition.READY, "False", reason, message),
        *more,
    ):
        conditions = set_condition(conditions, cond, status, why, text, when, world.generation)
    new = {"phase": Phase.FAILED.value, "observedGeneration": world.generation, "conditions": conditions}
    effects: list[Effect] = list(scaled)
    if not said_before(state.raw.get("conditions") or [], reason, message):
        effects.append(PostEvent("Warning", reason, message, repeat=True))  # once per change
    patch = status_patch(state.raw, new)
    if patch is not None:
        effects.append(WriteStatus(patch))
    next_state = ServiceState.from_status(merged_status(state.raw, new))
    return Step(next_state, tuple(effects), None, Phase.FAILED.value)
