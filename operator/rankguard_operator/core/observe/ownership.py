"""Which pods an LLMService trusts: those its own Deployment made, by the owner chain.

A multi-node service's pods (spec.distributed) are made by StatefulSets instead: such a pod
counts when its controller is a StatefulSet whose controller is X.

Labels are not a trust boundary: anyone who may create a pod in the namespace can give it
rankguard's labels, and a pod's termination message and its agent's `/report` drive the KV
budget. So a pod counts for LLMService X only when its controller is a ReplicaSet whose
controller is the Deployment rankguard applied for X, and that Deployment's controller is X
itself (by UID, so a Deployment or ReplicaSet re-created under the same name by someone else
does not count). Reports are scraped only from the IPs of the pods that pass. Everything else
is ignored, with a reason the edge counts (docs/security.md has the threat model).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

IgnoredReason = Literal[
    "no-owner", "foreign-owner", "unknown-replicaset", "no-deployment", "unknown-statefulset"
]


@dataclass(frozen=True)
class Ignored:
    pod: str
    uid: str
    reason: IgnoredReason


def controller_of(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, uid) of the object's controller ownerReference, or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return str(ref.get("kind") or ""), str(ref.get("uid") or "")
    return None


def owned_deployment_uid(deployment: Mapping[str, Any] | None, service_uid: str) -> str | None:
    """The Deployment's UID when the LLMService with `service_uid` is its controller."""
    if deployment is None or not service_uid:
        return None
    if controller_of(deployment) != ("LLMService", service_uid):
        return None
    uid = (deployment.get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def owned_statefulsets(
    statefulsets: Sequence[Mapping[str, Any]], service_uid: str
) -> list[Mapping[str, Any]]:
    """The StatefulSets whose controller is the LLMService with `service_uid`."""
    return [s for s in statefulsets if service_uid and controller_of(s) == ("LLMService", service_uid)]


def trusted_pods(
    pods: Sequence[Mapping[str, Any]],
    replicaset_owner: Mapping[str, str],
    deployment: Mapping[str, Any] | None,
    service_uid: str,
    statefulsets: Sequence[Mapping[str, Any]] = (),
) -> tuple[list[Mapping[str, Any]], list[Ignored]]:
    """Split `pods` (found by rankguard's labels) into those whose owner chain leads to the
    LLMService and those to ignore. `replicaset_owner` maps a ReplicaSet's UID to its
    controller Deployment's UID (the ReplicaSets carrying rankguard's labels); `statefulsets`
    are the StatefulSets carrying rankguard's labels (a multi-node service's groups)."""
    deployment_uid = owned_deployment_uid(deployment, service_uid)
    sets = {
        str((s.get("metadata") or {}).get("uid") or "") for s in owned_statefulsets(statefulsets, service_uid)
    }
    watched = {str((s.get("metadata") or {}).get("uid") or "") for s in statefulsets}
    trusted: list[Mapping[str, Any]] = []
    ignored: list[Ignored] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        name, uid = str(meta.get("name") or ""), str(meta.get("uid") or "")
        owner = controller_of(pod)
        if owner is not None and owner[0] == "StatefulSet":
            if owner[1] in sets:
                trusted.append(pod)
            else:
                # a set the watch has not delivered yet counts from the pass after it arrives
                reason: IgnoredReason = "foreign-owner" if owner[1] in watched else "unknown-statefulset"
                ignored.append(Ignored(name, uid, reason))
        elif owner is None or owner[0] != "ReplicaSet":
            ignored.append(Ignored(name, uid, "no-owner"))
        elif deployment_uid is None:
            # no Deployment of ours (yet, or it was replaced): no pod can be vouched for
            ignored.append(Ignored(name, uid, "no-deployment"))
        elif owner[1] not in replicaset_owner:
            # a ReplicaSet without our labels, or one the watch has not delivered yet: the
            # pod counts from the pass after its ReplicaSet arrives (its event wakes the loop)
            ignored.append(Ignored(name, uid, "unknown-replicaset"))
        elif replicaset_owner[owner[1]] != deployment_uid:
            ignored.append(Ignored(name, uid, "foreign-owner"))
        else:
            trusted.append(pod)
    return trusted, ignored
