"""The pass's first decision: finish what a previous pass decided, maybe before a restart,
exactly once.

A remediation writes its intent (`status.pendingRemediation`, with its history record) before
the roll, and the roll stamps the intent's id on the Deployment. A pass that finds the intent
rolls only when the Deployment does not carry that id, and records the history entry when the
pass that decided it died first. The remediation's Event is named after the id, so posting it
again after a restart is a no-op.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.effects import Effect, PostEvent
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.status.build import append_history
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step.rendering import Live, Renderer, apply
from rankguard_operator.core.step.world import merge_keys, remediation_id_of


@dataclass(frozen=True)
class Finished:
    live: Live
    effects: tuple[Effect, ...]
    current: ServingFlags | None  # the flags in effect once the pending roll is done
    handled: tuple[str, ...]  # termination keys handled, the pending remediation's included
    history: list[dict[str, Any]]
    cleared: bool  # a pending remediation was finished: status.pendingRemediation goes


def finish_pending(state: ServiceState, live: Live, renderer: Renderer) -> Finished:
    history = [dict(h) for h in state.history]
    pending = state.pending
    if pending is None:
        return Finished(live, (), state.serving_flags, tuple(state.handled), history, cleared=False)
    effects: list[Effect] = []
    target = pending.to_flags
    if target is not None and remediation_id_of(live.deployment) != pending.id:
        live, applied = apply(live, renderer.render(target, pending.id))
        effects += applied
    record = pending.record
    if record is not None and not any(h.get("revision") == pending.id for h in history):
        # The pass that decided this died before writing its history: write it now. Its Event
        # is named after the id, so it is posted once whoever gets there first.
        history = append_history(history, record)
        message = str(record.get("message") or "")
        effects.append(PostEvent("Warning", "RemediationResumed", message, name=pending.id))
    return Finished(
        live,
        tuple(effects),
        target or state.serving_flags,
        merge_keys(state.handled, pending.terminations),
        history,
        cleared=True,
    )
