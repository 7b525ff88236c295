"""The pass's decision, and what it does at once: the policy's verdict on what was observed,
then, when it changes the flags, the intent written before the roll, the roll, the history
record and the Event.

The intent first: a crash between it and the roll is finished by the next pass
(core/step/pending), and the Event is named after the remediation's id.

Pure: no I/O, no clock (`world.now`), no random (`world.new_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from rankguard_operator.core import policy
from rankguard_operator.core.effects import Effect, PostEvent, WriteIntent
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.groups import Groups
from rankguard_operator.core.policy.history import STATUS_ACTIONS, history_from_status
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.build import append_history
from rankguard_operator.core.status.service_state import PendingRemediation, ServiceState
from rankguard_operator.core.step.observed import Observed
from rankguard_operator.core.step.rendering import Live, Renderer, apply
from rankguard_operator.core.step.sizing import Sized
from rankguard_operator.core.units import iso


def decide(
    state: ServiceState,
    spec: ServiceSpec,
    now: float,
    *,
    current: ServingFlags | None,
    seen: Observed,
    sized: Sized,
    history: list[dict[str, Any]],
) -> policy.Decision:
    return policy.decide(
        policy.PolicyInput(
            spec=spec,
            now=now,
            current=current,
            last_known_good=state.last_known_good,
            observation=seen.observation,
            new_terminations=seen.terminations,
            rollout=seen.rollout,
            history=history_from_status(history),
            plan=sized.plan,
            prior=sized.prior,
            low_headroom_since=seen.low_since,
            ample_headroom_since=seen.ample_since,
            ample_headroom_lowest=seen.ample_lowest,
            budget_key=state.budget_key if current is not None else None,
            sizing=sized.mode,
            outside=sized.outside,
        )
    )


# Where a change was triggered: (the pod, its group of a multi-node service); None when unknown.
Where = tuple[str | None, int | None]


def located(decision: policy.Decision, seen: Observed, groups: Groups | None) -> Where:
    """The pod a decision answers and its group, for the history record: the pod of the run it
    handles (the one of its rank first), else the pod whose figures of its rank it read (the
    worst replica's)."""
    ended = [t for t in seen.terminations if t.key in decision.handled]
    ended.sort(key=lambda t: t.rank != decision.rank)  # its own rank's run first, stable otherwise
    pod: str | None = ended[0].pod_name if ended else None
    if pod is None and decision.rank is not None:
        row = seen.observation.rank(decision.rank)
        pod = None if row is None else row.pod
    if pod is None or groups is None:
        return pod, None
    return pod, groups.index_of(pod)


@dataclass(frozen=True)
class Acted:
    live: Live
    effects: tuple[Effect, ...]
    current: ServingFlags | None  # the flags in effect after the decision
    history: list[dict[str, Any]]
    intent: Mapping[str, Any] | None = None  # the intent written this pass (status as stored)
    new_revision: bool = False  # a new revision starts its own headroom clocks


def act(
    decision: policy.Decision,
    now: float,
    new_id: str,
    *,
    renderer: Renderer,
    live: Live,
    current: ServingFlags | None,
    history: list[dict[str, Any]],
    where: Where = (None, None),
) -> Acted:
    if current is None:
        # the first render: nothing to roll back from
        said = PostEvent("Normal", decision.reason, decision.message, repeat=True)
        return Acted(live, (said,), decision.flags, history)
    if decision.changes_flags:
        return _change_flags(decision, now, new_id, renderer, live, current, history, where)
    if decision.action == "none" and decision.trigger in policy.CRASH_TRIGGERS and decision.message:
        # a crash answered without a change of flags (e.g. a start-up check refusal: the render
        # changes instead); said once per termination
        said = PostEvent("Warning", decision.reason, decision.message, repeat=True)
        return Acted(live, (said,), current, history)
    # ("degrade" and "hold" are said once per change of the Degraded condition, in the report)
    return Acted(live, (), current, history)


def _change_flags(  # noqa: PLR0917 - act's inputs, as it has them
    decision: policy.Decision,
    now: float,
    rid: str,
    renderer: Renderer,
    live: Live,
    current: ServingFlags,
    history: list[dict[str, Any]],
    where: Where,
) -> Acted:
    record = decision.remediation(now, revision=rid) if decision.is_remediation else None
    if record is not None:
        record = replace(record, pod=where[0], group=where[1])
    intent = PendingRemediation(
        id=rid,
        kind=decision.action,
        started_at=iso(now),
        from_flags=current,
        to_flags=decision.flags,
        terminations=decision.handled,
        record=None if record is None else record.to_status(),
    ).to_status()
    effects: list[Effect] = [WriteIntent(intent)]
    live, applied = apply(
        live,
        renderer.render(decision.flags, rid),
        remediation_id=rid if record is not None else None,
        action=STATUS_ACTIONS.get(decision.action, decision.action),
        trigger=decision.trigger,
    )
    effects += applied
    if record is not None:
        history = append_history(history, record)
    kind: Literal["Normal", "Warning"] = "Normal" if decision.action in ("grow", "replan") else "Warning"
    effects.append(PostEvent(kind, decision.reason, decision.message, name=rid))
    return Acted(live, tuple(effects), decision.flags, history, intent=intent, new_revision=True)
