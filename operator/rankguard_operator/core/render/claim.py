"""spec.modelCache: the claim rankguard creates (or the user names), and the ModelCacheReady
condition that says whether it is bound.

The edge reads the claim every pass (`step.surroundings.reads` says which; None when it does not exist)
and carries out `ApplyClaim` before the Deployment's apply, so the first pod finds its claim.
A claim's spec is mostly immutable: a change the API server refuses goes the executor's
ApplyRefused way (Degraded with the server's message, retried each pass), never a crash loop.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from rankguard_operator.core.conditions import Condition
from rankguard_operator.core.names import labels, owner_reference
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.spec.pod import ModelCacheSpec
from rankguard_operator.core.units import format_quantity

CONDITION = Condition.MODEL_CACHE_READY
BOUND, NOT_FOUND, PENDING, LOST = "Bound", "ClaimNotFound", "ClaimPending", "ClaimLost"
_EVENTS: dict[str, tuple[Literal["Normal", "Warning"], str]] = {
    BOUND: ("Normal", "ModelCacheBound"),
    NOT_FOUND: ("Warning", "ModelCacheClaimNotFound"),
    PENDING: ("Normal", "ModelCacheClaimPending"),
    LOST: ("Warning", "ModelCacheClaimLost"),
}


def _owned_by(claim: Mapping[str, Any], uid: str) -> bool:
    refs = (claim.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, Mapping) and r.get("uid") == uid for r in refs)


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
    cache: ModelCacheSpec, service: str, namespace: str, claim: Mapping[str, Any] | None
) -> tuple[str, str, str]:
    """(status, reason, message) of ModelCacheReady for the claim as read this pass."""
    name = cache.claim(service)
    where = f"PersistentVolumeClaim {name} in namespace {namespace}"
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
