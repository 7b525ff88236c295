"""The effects of a reconcile step: values the edge carries out, in the order given.

Pure: no I/O (these only describe what to do).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class WriteIntent:
    """Merge-patch `.status.pendingRemediation` BEFORE the roll it announces."""

    pending: Mapping[str, Any]


@dataclass(frozen=True)
class ApplyDeployment:
    body: Mapping[str, Any]
    remediation_id: str | None = None  # the roll of a remediation (counted once in metrics)
    action: str | None = None
    trigger: str | None = None


@dataclass(frozen=True)
class ApplyObject:
    """Server-side apply one object of a multi-node service's groups (a StatefulSet, the
    headless Service, a LeaderWorkerSet): core/step/group_roll decides which, pass by pass."""

    body: Mapping[str, Any]


@dataclass(frozen=True)
class DeleteObject:
    """Delete an object rankguard rendered and no longer wants (a group beyond spec.replicas, or
    what a service's old shape applied: its Deployment, StatefulSets, headless Service or
    LeaderWorkerSet). The edge deletes it only when this LLMService is its controller; one
    already gone is fine."""

    kind: str
    name: str
    namespace: str


@dataclass(frozen=True)
class ApplyService:
    body: Mapping[str, Any]


@dataclass(frozen=True)
class ApplyClaim:
    """Server-side apply the model cache's PersistentVolumeClaim (spec.modelCache.size), before
    the Deployment that mounts it."""

    body: Mapping[str, Any]


@dataclass(frozen=True)
class PostEvent:
    """An Event on the LLMService. `name` makes it idempotent (a remediation's Event is named
    after its id); `repeat` events are rate-limited by reason at the edge, since a state that
    lasts (a hold, Degraded) is re-decided every pass."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    name: str | None = None
    repeat: bool = False


@dataclass(frozen=True)
class WriteStatus:
    """A JSON merge patch of `.status` (only what changed)."""

    patch: Mapping[str, Any]


Effect = (
    ApplyClaim
    | WriteIntent
    | ApplyDeployment
    | ApplyObject
    | DeleteObject
    | ApplyService
    | PostEvent
    | WriteStatus
)
