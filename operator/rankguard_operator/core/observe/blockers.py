"""What keeps a service from serving that no decision of the policy answers, as observed on its
pods: today a replica the scheduler cannot place (PodScheduled False, reason Unschedulable).

The scheduler says so at once, also while it only waits: with maxSurge 0 a rolled pod waits
for the GPUs its predecessor still holds while that one terminates. So a pod counts only once
no pod of the service is terminating, and the service is Degraded once some pod has stayed
unschedulable for UNSCHEDULABLE_AFTER_SECONDS since then (`status.unschedulableSince`, this
module's clock, kept across passes and restarts like the headroom clocks).

Pure: no I/O, no clock (`now` is an argument).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.observe.pods import get_path

# How long a pod must stay unschedulable (with no pod of the service terminating) before the
# service is Degraded: the scheduler retries a pod within its back-off (at most 10 s) when
# something frees up, so a wait longer than that is not one of its retries.
UNSCHEDULABLE_AFTER_SECONDS = 30.0
# The scheduler's message as quoted in the condition: it lists every node's reason, which on a
# large cluster runs to kilobytes.
SCHEDULER_MESSAGE_CHARS = 400


@dataclass(frozen=True)
class Unschedulable:
    since: float | None  # status.unschedulableSince for the next pass (None: nothing waits)
    blocker: tuple[str, str] | None  # (reason, message) once it has lasted; None before
    due_in: float | None = None  # seconds until the verdict falls due (a pass is needed then)


def scheduler_verdict(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when it cannot place `pod` (PodScheduled False, Unschedulable)."""
    for c in get_path(pod, "status", "conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled":
            if c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return str(c.get("message") or "no message from the scheduler")
            return None
    return None


def bounded(text: str, limit: int = SCHEDULER_MESSAGE_CHARS) -> str:
    """`text` with its whitespace folded, cut to `limit` characters (Kubernetes' messages quoted
    in a condition: a scheduler's lists every node, a kubelet's can carry a stack)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def unschedulable(
    pods: Sequence[Mapping[str, Any]],
    since: float | None,
    now: float,
    *,
    gpus: int,
    gpu_resource: str,
) -> Unschedulable:
    """Track the service's unschedulable pods; a blocker once one has waited long enough."""
    if any(get_path(p, "metadata", "deletionTimestamp") for p in pods):
        return Unschedulable(None, None)  # a predecessor may still hold the GPUs
    waiting = sorted(
        (str(get_path(p, "metadata", "name") or ""), msg)
        for p in pods
        if (msg := scheduler_verdict(p)) is not None
    )
    if not waiting:
        return Unschedulable(None, None)
    start = now if since is None or since > now else since
    if now - start < UNSCHEDULABLE_AFTER_SECONDS:
        return Unschedulable(start, None, start + UNSCHEDULABLE_AFTER_SECONDS - now)
    name, message = waiting[0]
    others = f" ({len(waiting) - 1} more pod(s) wait too)" if len(waiting) > 1 else ""
    return Unschedulable(
        start,
        (
            "Unschedulable",
            f"the scheduler cannot place pod {name}{others}: "
            f'"{bounded(message)}". Each replica asks for {gpus} {gpu_resource} on one node '
            "(spec.tensorParallelSize × spec.pipelineParallelSize); free or add such GPUs, lower "
            "the split, or fix spec.template's nodeSelector, affinity and tolerations",
        ),
    )
