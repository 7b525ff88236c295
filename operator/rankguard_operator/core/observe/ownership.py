"""Which pods an LLMService trusts: those its own Deployment made, by the owner chain and
by provenance.

A multi-node service's pods (spec.distributed) are made by StatefulSets instead: such a pod
counts when its controller is a StatefulSet whose controller is X.

Labels are not a trust boundary: anyone who may create a pod in the namespace can give it
rankguard's labels, and a pod's termination message and its agent's `/report` drive the KV
budget. So a pod counts for LLMService X only when its controller is a ReplicaSet whose
controller is the Deployment rankguard applied for X, and that Deployment's controller is X
itself (by UID, so a Deployment or ReplicaSet re-created under the same name by someone else
does not count).

Owner references prove nothing either: the API server takes any ownerReference on create,
and labels and ownerReferences can be patched onto a pod that has already failed (the
ReplicaSet controller never counts or deletes a Failed pod, so such a pod lingers). What a
pod's maker cannot fake afterwards is its spec, which is immutable: so a pod also counts only
when it is what its owner makes (provenance): its name is its owner's pod name (a ReplicaSet's
`<name>-<5 random characters>`, a StatefulSet's `<name>-<ordinal>`), and its restartPolicy and
`vllm` container (image, command, args, env) are exactly its owner's pod template's. The
comparison is by `template_fingerprint`, computed the same way on both sides, so the edge
keeps 32 characters per ReplicaSet and per pod, not their bodies. Only those fields: the API
server defaults a pod and a template alike, but admission (a LimitRange, a mutating webhook
that injects sidecars or volumes) changes a pod and not its template, and a forger gains
nothing from those. (docs/security.md: an admission policy that stops the forged pod from
being created or patched at all.)

Reports are scraped only from the IPs of the pods that pass. Everything else is ignored,
with a reason the edge counts (docs/security.md has the threat model).

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.names import VLLM_CONTAINER

IgnoredReason = Literal[
    "no-owner",
    "foreign-owner",
    "unknown-replicaset",
    "no-deployment",
    "unknown-statefulset",
    "wrong-name",
    "not-from-template",
]

# Where the edge's compact copy of a pod (edge/handlers.serving_pods) keeps the fingerprint
# of the spec it dropped. The API server keeps no unknown top-level field, so a pod read from
# it never carries this key of its own.
FINGERPRINT_KEY = "templateFingerprint"
# The fields of the vllm container a pod must share with its owner's template.
_COMPARED = ("image", "command", "args", "env")
# A ReplicaSet's pods are named by the API server's generateName: the prefix `<rs-name>-`,
# cut to 58 characters, then 5 random lower-case letters and digits (k8s.io/apiserver's
# names.SimpleNameGenerator; its alphabet is a subset, not pinned here so that a change of it
# never leaves every pod untrusted).
_GENERATED_MAX = 58
_RANDOM_LENGTH = 5
_RANDOM_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")


@dataclass(frozen=True)
class Ignored:
    pod: str
    uid: str
    reason: IgnoredReason


@dataclass(frozen=True)
class ReplicaSetRef:
    """What the edge keeps of one ReplicaSet (edge/handlers.replicaset_owners): enough to
    vouch for its pods, and no more (a thousand services keep several ReplicaSets each)."""

    owner_uid: str  # its controller's UID ("" when it has none)
    name: str
    template: str  # template_fingerprint of its spec.template.spec


def template_fingerprint(pod_spec: Mapping[str, Any] | None) -> str:
    """A digest of what a pod must share with its owner's template: restartPolicy and the
    vllm container's image, command, args and env, as the API server stores them. Used for
    the template and for the pod alike. "" when there is no vllm container (matches nothing)."""
    spec = pod_spec if isinstance(pod_spec, Mapping) else {}
    vllm = next(
        (
            c
            for c in spec.get("containers") or []
            if isinstance(c, Mapping) and c.get("name") == VLLM_CONTAINER
        ),
        None,
    )
    if vllm is None:
        return ""
    # an absent list and an empty one are the same to the kubelet (and to the API server's
    # JSON, which omits empty fields)
    doc = {
        "restartPolicy": spec.get("restartPolicy") or "",
        "vllm": {k: vllm.get(k) or ([] if k != "image" else "") for k in _COMPARED},
    }
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))  # ASCII: any string encodes
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def pod_fingerprint(pod: Mapping[str, Any]) -> str:
    """The pod's template_fingerprint: the one the edge's compact copy carries, else computed
    from the pod's spec (a whole pod, as tests and the offline tools hold it)."""
    kept = pod.get(FINGERPRINT_KEY)
    return str(kept) if isinstance(kept, str) else template_fingerprint(pod.get("spec"))


def replicaset_ref(replicaset: Mapping[str, Any]) -> ReplicaSetRef:
    """A ReplicaSet body (as the watch delivers it) -> what trusted_pods needs of it."""
    meta = replicaset.get("metadata") or {}
    owner = controller_of(replicaset)
    template = ((replicaset.get("spec") or {}).get("template") or {}).get("spec")
    return ReplicaSetRef(
        owner_uid=owner[1] if owner is not None else "",
        name=str(meta.get("name") or ""),
        template=template_fingerprint(template),
    )


def named_by_replicaset(pod_name: str, replicaset_name: str) -> bool:
    """The ReplicaSet controller's pod name: `<rs-name>-` (cut to 58) + 5 random characters."""
    prefix = f"{replicaset_name}-"[:_GENERATED_MAX]
    suffix = pod_name[len(prefix) :]
    return (
        bool(replicaset_name)
        and pod_name.startswith(prefix)
        and len(suffix) == _RANDOM_LENGTH
        and set(suffix) <= _RANDOM_ALPHABET
    )


def named_by_statefulset(pod_name: str, set_name: str) -> bool:
    """The StatefulSet controller's pod name: `<set-name>-<ordinal>`."""
    prefix = f"{set_name}-"
    ordinal = pod_name[len(prefix) :]
    return (
        bool(set_name)
        and pod_name.startswith(prefix)
        and ordinal.isascii()
        and ordinal.isdigit()
        and (ordinal == "0" or not ordinal.startswith("0"))
    )


# What a pod ignored for its provenance most likely is when it is the service's own: a pod a
# mutating admission webhook changed after the ReplicaSet made it (docs/security.md).
_PROVENANCE_HINT = (
    " If the pod is one its ReplicaSet or StatefulSet made, a mutating admission webhook changed "
    "its vllm container's command, args or env (or its restartPolicy): exclude the serving "
    "namespace from that webhook, or the service's pods are never trusted (docs/security.md)"
)


def ignored_message(ignored: Ignored) -> str:
    """The PodIgnored Event's message: which pod, why, and, for a provenance reason, the one
    way a pod of the service's own gets there."""
    hint = _PROVENANCE_HINT if ignored.reason in ("wrong-name", "not-from-template") else ""
    return (
        f"pod {ignored.pod} carries this service's labels but was not made by its workload "
        f"({ignored.reason}): it is never scraped nor acted upon.{hint}"
    )


def ignored_event(ignored: Ignored) -> PostEvent:
    """The Warning Event on the LLMService for a pod it ignores (rate-limited by the edge)."""
    return PostEvent("Warning", "PodIgnored", ignored_message(ignored), repeat=True)


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


def statefulset_fingerprint(statefulset: Mapping[str, Any]) -> str:
    """The template_fingerprint of a StatefulSet's pod template."""
    return template_fingerprint(((statefulset.get("spec") or {}).get("template") or {}).get("spec"))


def _provenance(pod: Mapping[str, Any], named: bool, templates: Collection[str]) -> IgnoredReason | None:
    """Why a pod with a good owner chain is still not its owner's: its name, then its spec."""
    if not named:
        return "wrong-name"
    fingerprint = pod_fingerprint(pod)
    if not fingerprint or fingerprint not in templates:
        return "not-from-template"
    return None


def trusted_pods(
    pods: Sequence[Mapping[str, Any]],
    replicasets: Mapping[str, ReplicaSetRef],
    deployment: Mapping[str, Any] | None,
    service_uid: str,
    *,
    statefulsets: Sequence[Mapping[str, Any]] = (),
    earlier_set_templates: Mapping[str, Collection[str]] | None = None,
) -> tuple[list[Mapping[str, Any]], list[Ignored]]:
    """Split `pods` (found by rankguard's labels) into those whose owner chain leads to the
    LLMService and that their owner made (name and template), and those to ignore.

    `replicasets`: ReplicaSet UID -> ReplicaSetRef, for the ReplicaSets carrying rankguard's
    labels. `statefulsets`: the StatefulSets carrying rankguard's labels (a multi-node
    service's groups). `earlier_set_templates`: StatefulSet UID -> fingerprints of templates
    that set carried before (a group replace applies the new template at zero replicas while
    the old pods still terminate, and a group must not look empty before they are gone)."""
    deployment_uid = owned_deployment_uid(deployment, service_uid)
    owned = owned_statefulsets(statefulsets, service_uid)
    earlier = earlier_set_templates or {}
    sets = {
        uid: (
            str((s.get("metadata") or {}).get("name") or ""),
            {statefulset_fingerprint(s), *earlier.get(uid, ())},
        )
        for s in owned
        for uid in [str((s.get("metadata") or {}).get("uid") or "")]
    }
    watched = {str((s.get("metadata") or {}).get("uid") or "") for s in statefulsets}
    trusted: list[Mapping[str, Any]] = []
    ignored: list[Ignored] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        name, uid = str(meta.get("name") or ""), str(meta.get("uid") or "")
        owner = controller_of(pod)
        reason: IgnoredReason | None
        if owner is not None and owner[0] == "StatefulSet":
            if owner[1] in sets:
                set_name, templates = sets[owner[1]]
                reason = _provenance(pod, named_by_statefulset(name, set_name), templates)
            else:
                # a set the watch has not delivered yet counts from the pass after it arrives
                reason = "foreign-owner" if owner[1] in watched else "unknown-statefulset"
        elif owner is None or owner[0] != "ReplicaSet":
            reason = "no-owner"
        elif deployment_uid is None:
            # no Deployment of ours (yet, or it was replaced): no pod can be vouched for
            reason = "no-deployment"
        elif owner[1] not in replicasets:
            # a ReplicaSet without our labels, or one the watch has not delivered yet: the
            # pod counts from the pass after its ReplicaSet arrives (its event wakes the loop)
            reason = "unknown-replicaset"
        elif replicasets[owner[1]].owner_uid != deployment_uid:
            reason = "foreign-owner"
        else:
            rs = replicasets[owner[1]]
            reason = _provenance(pod, named_by_replicaset(name, rs.name), (rs.template,))
        if reason is None:
            trusted.append(pod)
        else:
            ignored.append(Ignored(name, uid, reason))
    return trusted, ignored
