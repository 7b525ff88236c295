"""One Event per change of the Degraded condition rather than one per pass (DESIGN §7, fail
loudly and once).

* `degraded_event`: the Warning Event for a Degraded condition that became True or changed its
  reason in this pass; a state that lasts is said once. The previous condition, as stored,
  says what was said (as step.surroundings does for AgentReady and ModelCacheReady).
* `said_before`: the stored Degraded condition already says exactly this (an invalid spec re-read).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rankguard_operator.core.conditions import Condition, condition
from rankguard_operator.core.effects import PostEvent


def degraded_event(
    stored: Sequence[Mapping[str, Any]],
    new: Sequence[Mapping[str, Any]],
    posted: Iterable[str] = (),
) -> PostEvent | None:
    """The Warning Event for Degraded when this pass made it True or changed its reason; None
    when it says what the stored condition said, or when an Event of that reason was already
    posted in this pass (a decision's own)."""
    now = condition(new, Condition.DEGRADED)
    if now is None or now.get("status") != "True":
        return None
    before = condition(stored, Condition.DEGRADED)
    reason = str(now.get("reason") or "Degraded")
    if before is not None and before.get("status") == "True" and before.get("reason") == reason:
        return None
    if reason in set(posted):
        return None
    return PostEvent("Warning", reason, str(now.get("message") or ""), repeat=True)


def said_before(stored: Sequence[Mapping[str, Any]], reason: str, message: str) -> bool:
    """The stored Degraded condition already says exactly this (an invalid spec re-read)."""
    before = condition(stored, Condition.DEGRADED)
    return (
        before is not None
        and before.get("status") == "True"
        and before.get("reason") == reason
        and before.get("message") == message
    )
