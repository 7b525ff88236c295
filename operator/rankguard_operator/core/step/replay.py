"""A step's effects carried out on objects in memory, the way the edge carries them out against the
API server: for whoever runs the step without a cluster (`rankguard render`, the strategy bench,
the step's own tests), so none of them writes its own copy of the executor's rules.

What the API server would do with each effect:

* `WriteIntent` / `WriteStatus`: a merge patch of `.status` (RFC 7386, status.patch.merge_patch);
* `ApplyDeployment`: server-side apply; the object as stored is `world.after_apply`'s (the live
  status kept, a new generation when the spec changed);
* `ApplyService` / `ApplyClaim`: server-side apply of the whole body (the claim keeps the status
  its controller wrote);
* `ApplyObject` / `DeleteObject`: a multi-node service's StatefulSets (or LeaderWorkerSet) and
  headless Service, kept by kind and name, removed when deleted;
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
    ApplyObject,
    ApplyService,
    DeleteObject,
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
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (kind, name) -> body
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
        elif (
            isinstance(effect, ApplyService)
            and self.service is not None
            and _name(effect.body) != _name(self.service)
        ):
            body = copy.deepcopy(dict(effect.body))  # a multi-node service's headless Service
            self.objects[("Service", _name(body))] = body
            self.applied.append(body)
        elif isinstance(effect, ApplyService):
            self.service = copy.deepcopy(dict(effect.body))
            self.applied.append(self.service)
        elif isinstance(effect, ApplyObject):
            body = copy.deepcopy(dict(effect.body))
            self.objects[(str(body["kind"]), _name(body))] = body
            self.applied.append(body)
        elif isinstance(effect, DeleteObject):
            self.objects.pop((effect.kind, effect.name), None)
            if effect.kind == "Deployment":
                self.deployment = None
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

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """The objects of `kind` held now (a multi-node service's StatefulSets), by name."""
        return [body for (k, _), body in sorted(self.objects.items()) if k == kind]

    @property
    def deployments_applied(self) -> list[Mapping[str, Any]]:
        """Every Deployment body applied, in order (each roll, and each re-apply)."""
        return [b for b in self.applied if b.get("kind") == "Deployment"]


def _name(body: Mapping[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("name") or "")
