"""spec.modelCache: the claim rankguard creates (or the user names), and the ModelCacheReady
condition that says whether it is bound.

A claim whose controller is another LLMService (`borrowed_from`) is refused, not used: the
garbage collector deletes it with that service, under this one's running pods, and the next
roll would wait for it forever. A claim you keep yourself (claimName, no LLMService controller)
may be shared by any number of services. A claim being deleted (Terminating: kept only while a
pod mounts it) makes ModelCacheReady False, and it turns True again once a bound claim is back.

The edge reads the claim every pass (`core.step.needs` says which; None when it does not exist)
and carries out `ApplyClaim` before the Deployment's apply, so the first pod finds its claim.
A claim's spec is mostly immutable: a change the API server refuses goes the executor's
ApplyRefused way (Degraded with the server's message, retried each pass), never a crash loop.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from rankguard_operator.core.conditions import Condition
from rankguard_operator.core.names import OWNER_KIND, labels, owner_reference
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.spec.pod import ModelCacheSpec
from rankguard_operator.core.units import format_quantity

CONDITION = Condition.MODEL_CACHE_READY
BOUND, NOT_FOUND, PENDING, LOST = "Bound", "ClaimNotFound", "ClaimPending", "ClaimLost"
TERMINATING, TAKEN = "ClaimTerminating", "ClaimOwnedByAnotherService"
# Degraded's reason when spec.modelCache names another LLMService's claim
DEGRADED_TAKEN = "ModelCacheClaimTaken"
_EVENTS: dict[str, tuple[Literal["Normal", "Warning"], str]] = {
    BOUND: ("Normal", "ModelCacheBound"),
    NOT_FOUND: ("Warning", "ModelCacheClaimNotFound"),
    PENDING: ("Normal", "ModelCacheClaimPending"),
    LOST: ("Warning", "ModelCacheClaimLost"),
    TERMINATING: ("Warning", "ModelCacheClaimTerminating"),
    TAKEN: ("Warning", "ModelCacheClaimTaken"),
}


def _owned_by(claim: Mapping[str, Any], uid: str) -> bool:
    refs = (claim.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs)


def borrowed_from(claim: Mapping[str, Any] | None, uid: str) -> str | None:
    """The name of the other LLMService that controls `claim` (None: no claim, ours, or no
    LLMService's)."""
    refs = ((claim or {}).get("metadata") or {}).get("ownerReferences") or []
    for r in refs:
        if isinstance(r, Mapping) and r.get("controller") is True and r.get("kind") == OWNER_KIND:
            return None if r.get("uid") == uid else str(r.get("name") or "")
    return None


def claim_settled(claim: Mapping[str, Any] | None, service: str) -> bool:
    """Whether the edge may keep the claim as read for a while (edge/reads.KeptRead): Bound, not
    being deleted, and no other LLMService's. Any other claim is read every pass, so
    ModelCacheReady follows it (and a refused service sees the other's claim go)."""
    meta = (claim or {}).get("metadata") or {}
    theirs = [
        r
        for r in meta.get("ownerReferences") or []
        if isinstance(r, Mapping)
        and r.get("controller") is True
        and r.get("kind") == OWNER_KIND
        and r.get("name") != service
    ]
    phase = ((claim or {}).get("status") or {}).get("phase")
    return phase == "Bound" and not meta.get("deletionTimestamp") and not theirs


def taken_message(cache: ModelCacheSpec, service: str, namespace: str, owner: str) -> str:
    """Why a claim of another LLMService is refused, and what to do instead."""
    field = "spec.modelCache.claimName" if not cache.created else "spec.modelCache.size"
    return (
        f"PersistentVolumeClaim {cache.claim(service)} in namespace {namespace} ({field}) belongs "
        f"to LLMService {owner} (its controller): it is deleted with {owner}, under this "
        "service's pods, so rankguard does not use it and applies nothing for this service. Point "
        "spec.modelCache.claimName at a claim you create yourself (it may be shared by several "
        "services), or give spec.modelCache.size for one of this service's own"
    )


def claim_to_apply(
    spec: ServiceSpec,
    name: str,
    namespace: str,
    uid: str,
    claim: Mapping[str, Any] | None,
    *,
    spec_changed: bool,
) -> dict[str, Any] | None:
    """The claim to server-side apply this pass, or None. Only for spec.modelCache.size (a
    named claim is the user's), when it is missing or the spec may have changed it (the first
    pass, a new generation). A claim of that name that rankguard did not create is used as it
    is, never adopted (adopting it would make the garbage collector delete it with the
    LLMService)."""
    body = render_cache_claim(name, namespace, uid, spec)
    if body is None:
        return None
    if claim is not None and not _owned_by(claim, uid):
        return None
    if claim is None or spec_changed:
        return body
    return None


def _storage(claim: Mapping[str, Any]) -> str:
    cap = ((claim.get("status") or {}).get("capacity") or {}).get("storage")
    return f" ({cap})" if isinstance(cap, str) and cap else ""


def condition(
    cache: ModelCacheSpec,
    service: str,
    namespace: str,
    claim: Mapping[str, Any] | None,
    *,
    uid: str,
) -> tuple[str, str, str]:
    """(status, reason, message) of ModelCacheReady for the claim as read this pass (`uid`:
    this LLMService's, to tell another's claim)."""
    name = cache.claim(service)
    where = f"PersistentVolumeClaim {name} in namespace {namespace}"
    owner = borrowed_from(claim, uid)
    if owner is not None:
        return "False", TAKEN, taken_message(cache, service, namespace, owner)
    if claim is not None and (claim.get("metadata") or {}).get("deletionTimestamp"):
        fix = (
            "rankguard creates a new, empty one once it is gone"
            if cache.created
            else "re-create it once it is gone, or point spec.modelCache.claimName at another claim"
        )
        return (
            "False",
            TERMINATING,
            f"{where} is being deleted: it stays only while a pod mounts it, and new serving pods "
            f"cannot start on it; {fix}",
        )
    if claim is None:
        if cache.created:
            size = format_quantity(cache.size_bytes) if cache.size_bytes is not None else "?"
            return (
                "False",
                PENDING,
                f"rankguard is creating {where} ({size}, spec.modelCache.size); the serving pods stay "
                "Pending until it is bound",
            )
        return (
            "False",
            NOT_FOUND,
            f"{where} (spec.modelCache.claimName) does not exist: create it, or give "
            "spec.modelCache.size instead of claimName to let rankguard create one. The serving pods "
            "stay Pending until it exists",
        )
    phase = (claim.get("status") or {}).get("phase")
    volume = (claim.get("spec") or {}).get("volumeName") or ""
    if phase == "Bound":
        return "True", BOUND, f"{where} is bound to volume {volume}{_storage(claim)}"
    if phase == "Lost":
        fix = (
            "delete the claim and rankguard creates a new, empty one"
            if cache.created
            else "restore the volume or point spec.modelCache.claimName at another claim"
        )
        return (
            "False",
            LOST,
            f"{where} lost its volume {volume}: the PersistentVolume is gone, so the model cache cannot "
            f"be mounted and new serving pods cannot start; {fix}",
        )
    sc = (claim.get("spec") or {}).get("storageClassName")
    cls = f"storage class {sc}" if isinstance(sc, str) and sc else "no storage class"
    return (
        "False",
        PENDING,
        f"{where} is waiting for a volume ({cls}): no provisioner serves that class, or no "
        "PersistentVolume matches the claim (with a WaitForFirstConsumer class it binds once a "
        "serving pod is scheduled). The serving pods stay Pending until it binds",
    )


def event(
    previous: Mapping[str, Any] | None, reason: str, message: str
) -> tuple[Literal["Normal", "Warning"], str, str] | None:
    """The Event to post when ModelCacheReady's reason changes (once per change, not per pass)."""
    if previous is not None and previous.get("reason") == reason:
        return None
    kind, event_reason = _EVENTS[reason]
    return kind, event_reason, message


def render_cache_claim(name: str, namespace: str, owner_uid: str, spec: ServiceSpec) -> dict[str, Any] | None:
    """The PersistentVolumeClaim for spec.modelCache.size (None when the spec names an existing
    claim, or no cache). Owned by the LLMService, so it goes when the service goes; applied
    before the Deployment, so the first pod finds it."""
    cache = spec.model_cache
    if cache is None or not cache.created or cache.size_bytes is None:
        return None
    claim: dict[str, Any] = {
        "accessModes": list(cache.access_modes),
        "resources": {"requests": {"storage": format_quantity(cache.size_bytes)}},
    }
    if cache.storage_class is not None:
        claim["storageClassName"] = cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": cache.claim(name),
            "namespace": namespace,
            "labels": labels(name),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": claim,
    }
