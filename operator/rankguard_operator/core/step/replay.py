"""A step's effects carried out on objects in memory, the way the edge carries them out against the
API server: for whoever runs the step without a cluster (`rankguard render`, the strategy bench,
the step's own tests), so none of them writes its own copy of the executor's rules.

What the API server would do with each effect:

* `WriteIntent` / `WriteStatus`: a merge patch of `.status` (RFC 7386, status.patch.merge_patch);
* `ApplyDeployment`: server-side apply; the object as stored is `world.after_apply`'s (the live
  status kept, a new generation when the spec changed);
* `ApplyService` / `ApplyClaim`: server-side apply of the whole body (the claim keeps the status
  its controller wrote);
* `PostEvent`: an Event created under its name when it has one, so posting it again is refused
  (the executor's 409) and it is kept once; an unnamed Event is kept every time.

`applied` keeps every body in the order it was sent, as `kubectl apply` would have received them.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.effects import (
    ApplyClaim,
    ApplyDeployment,
    ApplyService,
    Effect,
    PostEvent,
    WriteIntent,
    WriteStatus,
)
from rankguard_operator.core.status.patch import merge_patch
from rankguard_operator.core.step.world import after_apply


@dataclass
class Objects:
    """What the API server holds for one LLMService, changed only through effects."""

    status: dict[str, Any] = field(default_factory=dict)
    deployment: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    claim: dict[str, Any] | None = None
    events: dict[str, PostEvent] = field(default_factory=dict)  # by the Event's name
    applied: list[dict[str, Any]] = field(default_factory=list)  # every body applied, in order

    def carry_out(self, effect: Effect) -> None:
        if isinstance(effect, WriteIntent):
            self.status = merge_patch(self.status, {"pendingRemediation": dict(effect.pending)})
        elif isinstance(effect, WriteStatus):
            self.status = merge_patch(self.status, effect.patch)
        elif isinstance(effect, ApplyDeployment):
            body = copy.deepcopy(dict(effect.body))  # the step's value stays untouched
            self.applied.append(body)
            self.deployment = after_apply(self.deployment, body)
        elif isinstance(effect, ApplyService):
            self.service = copy.deepcopy(dict(effect.body))
            self.applied.append(self.service)
        elif isinstance(effect, ApplyClaim):
            body = copy.deepcopy(dict(effect.body))
            self.applied.append(body)
            status = (self.claim or {}).get("status")
            self.claim = {**body, "status": status} if status is not None else dict(body)
        elif isinstance(effect, PostEvent):
            self.events.setdefault(effect.name or f"{effect.reason}#{len(self.events)}", effect)

    def carry_out_all(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            self.carry_out(effect)

    @property
    def deployments_applied(self) -> list[Mapping[str, Any]]:
        """Every Deployment body applied, in order (each roll, and each re-apply)."""
        return [b for b in self.applied if b.get("kind") == "Deployment"]
