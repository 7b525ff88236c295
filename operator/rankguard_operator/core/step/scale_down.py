"""A Failed service holds no GPUs (issue 30): when the spec cannot be served (core/step/reconcile's
`invalid_spec`) and none of the service's pods serves nor will, its Deployment (or its groups'
StatefulSets) is scaled to zero, so crash-looping pods do not keep GPUs others could use. "Nor
will": the refusal says the deployed render cannot run either (a pinned budget or floor the GPU
is found not to hold once its size is learned: budget.fits' BudgetDoesNotFit), or a pod of it
has already crashed (a restart, a termination, a Failed pod). A service that still serves, or
whose pods are still starting under the last good render, keeps it: an invalid edit loses
nothing. The Failed condition's message says which of the three.

Once the spec is fixed, the next pass renders again with spec.replicas (the
Deployment's replicas differ from the render: `same_template` is False and it is applied; a
group scaled to zero and empty is started again by core/step/group_roll).

A scaler (`kubectl scale`, an HPA or KEDA through the scale subresource) that moves
spec.replicas meanwhile moves nothing: the workload stays at zero while the spec is refused, its
pods would crash as the others did, and status.replicas says 0. The count it asked for is in the
spec, and the fixed spec's render comes back with it.

The scaled object is the live one as rankguard applied it (same template, so no rollout), with
`spec.replicas` 0: the spec may not parse, so there is nothing to render from.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_operator.core.effects import ApplyDeployment, ApplyObject, Effect
from rankguard_operator.core.observe.ownership import controller_of
from rankguard_operator.core.observe.pods import get_path

# what a Failed condition adds, for each case (the same text every pass: one Event per change)
SCALED_TO_ZERO = (
    "None of its pods was serving, so rankguard scaled it to zero replicas: it holds no GPUs until "
    "the spec is fixed, then it is scaled back"
)
KEEPS_SERVING = (
    "Its ready pods keep serving the last good render until the spec is fixed; nothing was changed"
)
KEEPS_STARTING = "Its pods keep starting under the last good render (none has crashed); nothing was changed"
# a refusal whose workload must stop whatever its pods do (core/step/surroundings.Refusal.stop):
# a name another LLMService holds, whose Service selects this one's pods too
STOPPED = (
    "rankguard scaled its own workload to zero replicas, so none of its pods answers behind the "
    "other service's name; it is scaled back once the name is its own"
)
# metadata the API server or the controllers keep: never applied back
_SERVER_ANNOTATIONS = ("deployment.kubernetes.io/",)


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    return controller_of(obj) == ("LLMService", uid)


def _no_nulls(doc: Any) -> Any:
    """The object without null fields (a server-side apply reads a null as "not mine")."""
    if isinstance(doc, Mapping):
        return {k: _no_nulls(v) for k, v in doc.items() if v is not None}
    if isinstance(doc, list):
        return [_no_nulls(v) for v in doc]
    return doc


def at_zero(live: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """`live` as rankguard applies it, with no replicas."""
    meta = live.get("metadata") or {}
    keep = {k: meta[k] for k in ("name", "namespace", "labels", "ownerReferences") if k in meta}
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith(_SERVER_ANNOTATIONS)
    }
    if annotations:
        keep["annotations"] = annotations
    spec = {**(live.get("spec") or {}), "replicas": 0}
    body: dict[str, Any] = _no_nulls({"apiVersion": "apps/v1", "kind": kind, "metadata": keep, "spec": spec})
    return body


def crashed(pod: Mapping[str, Any]) -> bool:
    """Has any container of `pod` ended or restarted (or the pod failed)?"""
    if get_path(pod, "status", "phase") == "Failed":
        return True
    return any(
        int(c.get("restartCount") or 0) > 0 or "terminated" in (c.get("state") or {})
        for c in get_path(pod, "status", "containerStatuses") or []
        if isinstance(c, Mapping)
    )


def hold_nothing(
    deployment: Mapping[str, Any] | None,
    statefulsets: Sequence[Mapping[str, Any]],
    uid: str,
    pods: Sequence[Mapping[str, Any]] = (),
    *,
    cannot_run: bool = False,
    stop: bool = False,
) -> tuple[list[Effect], str]:
    """The applies that scale a Failed service's workload to zero when no pod of it is ready and
    none will be (`cannot_run`, or a pod has crashed), or at once (`stop`: ready pods too), and
    the sentence the Failed condition adds ("" when nothing of it is deployed). Only objects
    this LLMService controls (by UID) are touched: a rival of the same name owns its own."""
    owned: list[tuple[str, Mapping[str, Any]]] = [
        ("StatefulSet", s) for s in statefulsets if _controlled_by(s, uid)
    ]
    if deployment is not None and _controlled_by(deployment, uid):
        owned.append(("Deployment", deployment))
    if not owned:
        return [], ""
    ready = sum(int(get_path(o, "status", "readyReplicas") or 0) for _, o in owned)
    if ready > 0 and not stop:
        return [], KEEPS_SERVING
    if not cannot_run and not stop and not any(crashed(p) for p in pods):
        return [], KEEPS_STARTING
    effects: list[Effect] = []
    for kind, obj in owned:
        if get_path(obj, "spec", "replicas") == 0:
            continue  # already at zero
        body = at_zero(obj, kind)
        effects.append(ApplyDeployment(body) if kind == "Deployment" else ApplyObject(body))
    return effects, STOPPED if stop else SCALED_TO_ZERO
