"""The policy: one PURE function from everything observed to one explainable decision.

`decide(PolicyInput) -> Decision`. The caller gathers the inputs (spec, the flags the
Deployment runs, last-known-good flags, the aggregated agent reports, the terminations not
yet handled, the rollout state, the remediation history, the plan) and applies the result:
render `decision.flags` when `decision.changes_flags`, record `decision.remediation(...)` in
the history when `decision.is_remediation`, emit an Event with `reason`/`message`, mark
`decision.handled` termination keys as handled, and come back after `retry_after` seconds
when an action was held.

Rules, in the order they are tried (the first that applies wins):

 0. No flags yet -> "initial": the pinned budget (spec.memory.kvCacheMemoryBytes, never
    remediated), or the starting utilisation (spec.memory.gpuMemoryUtilization; the first
    CUDA OOM switches to bytes), or the planner's budget (priors, or probe figures when the
    caller planned with them). With no plan yet (GPU size unknown) vLLM starts at
    utilisation 0.9 and rule 8 converts to bytes once the agents report the GPUs. The same
    happens when the spec's budget inputs changed (`budget_key`): trigger "SpecChanged".
 0b. The image's own vLLM refused the arguments before the engine started (termination
    EngineRefusedArguments; with a Deployment, as long as a pod of the template in effect still
    refuses) -> Degraded "EngineRefusedArguments", quoting vLLM. Nothing ran: no remediation,
    no rollback (the spec's arguments would come back with it), never an OOM or a crash loop;
    the person's spec edit rolls once, and the condition clears when the new pods serve.
 1. CUDA OOM on rank r -> shrink by the deficit (requested − free) plus the safety margin.
    In utilisation mode the budget in effect is not a flag, so it is taken, in this order,
    from vLLM's own "Available KV cache memory" line of the failed run, from the live
    reports, or from the plan (util × total − the plan's non-KV estimate of rank r); without
    any of those the service is Degraded with a message asking for a budget or GPU size.
    A deficit the message did not state counts as max(256 MiB, 5 % of the budget).
    That is rule 1 for an OOM of an unknown phase or of the KV allocation; an OOM the agent
    placed in another engine phase moves that phase's lever instead (oom_levers.py: batched
    tokens, sequences, the capture size, enforce-eager; the weights' phase is Degraded).
 2. KVCacheTooSmall (vLLM refused to start) -> in utilisation mode with a plan whose budget
    fits one request, switch to it; otherwise Degraded, naming the knobs.
 3. OOMKilled -> raise the memory limit as the VPA does: max(old + 100 MiB, old × ratio),
    capped at spec.remediation.maxHostMemory (and the node's memory when given); at the cap
    -> Degraded, naming the knob.
 4. Rollout failed (ProgressDeadlineExceeded) -> roll back to last-known-good; with nothing
    to roll back to -> Degraded.
 5. EngineError under flags that differ from last-known-good -> roll back.
 5b. Any other EngineError: the first is said once ("none", reason EngineError; the pod
    restarts); a repeat (a later run of the same pod, or two pods at once) is a crash loop
    -> Degraded "EngineCrashLoop", quoting the engine's last error line.
 6. Within 15 min of a grow, the bottleneck's headroom fell below the minimum -> roll back
    to the budget before the grow ("HeadroomWorse").
 7. Bottleneck headroom below spec.memory.minHeadroomBytes for >= 60 s -> shrink by
    (minimum − headroom) + margin before an OOM happens.
 8. Measurement arrived: from utilisation-for-lack-of-a-plan to the plan's bytes, or, before
    any remediation, from the prior plan to the probe-measured plan ("replan").
 9. Reclaim (spec.memory.reclaim): every rank kept >= 2 × minHeadroom for >= 30 min and no
    change in that time -> grow by half the bottleneck's excess over the safety margin.

Guard rails on every flag change except "initial": spec.remediation.enabled false -> "hold";
then (rollbacks exempt: returning to known flags is always allowed) cooldown and maxPerHour
-> "hold" with `retry_after`. Every budget is whole KV blocks, never below the floor
(budget.kv_floor: one request at max_model_len, spec.remediation.minKVCacheBytes; below it ->
"degrade" at the floor, and a CUDA OOM with the budget already there -> "degrade" OOMAtFloor,
with no further roll) and never grown above the ceiling (budget.kv_ceiling, and for 24 h
never back past a budget that crashed or was under pressure).

Terminations of pods that ran other flags than the current ones are superseded (the change
they caused, or a later one, is already in place) and only marked handled.

Pure: no I/O, no clock (`now` is an input), deterministic.
"""

from __future__ import annotations

from rankguard_operator.core.policy.decide import decide
from rankguard_operator.core.policy.decision import Action, Decision, PolicyInput
from rankguard_operator.core.policy.trackers import (
    headroom_due_in,
    headroom_lines,
    next_last_known_good,
    track_ample_headroom,
    track_ample_lowest,
    track_low_headroom,
)
from rankguard_operator.core.policy.tunables import CRASH_TRIGGERS, DEFAULT_START_UTILIZATION

__all__ = [
    "CRASH_TRIGGERS",
    "DEFAULT_START_UTILIZATION",
    "Action",
    "Decision",
    "PolicyInput",
    "decide",
    "headroom_due_in",
    "headroom_lines",
    "next_last_known_good",
    "track_ample_headroom",
    "track_ample_lowest",
    "track_low_headroom",
]
