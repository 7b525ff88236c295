"""Which pods an LLMService trusts: those its own Deployment made, by the owner chain and
by provenance.

(Over 450 lines because trust is one rule read as a whole: each workload's owner chain, and
the provenance check, name and fingerprint, that every chain ends in.)

A multi-node service's pods (spec.distributed) are made by StatefulSets instead: such a pod
counts when its controller is a StatefulSet whose controller is X. Under
`workload: LeaderWorkerSet` the chain is the one LWS's controller builds (kubernetes-sigs/lws
v0.9.0 `pkg/controllers`, the same at v0.10.0): X controls the LeaderWorkerSet; the LWS controls
the leader StatefulSet (named as the LWS); that set controls each group's leader pod
`<lws>-<group>`; the leader POD controls its group's worker StatefulSet (named as the leader
pod); that set controls the workers `<lws>-<group>-<rank>`. Each link is checked by UID, every
set's name is the one LWS gives it, and a pod's spec is its set's template as LWS's pod webhook
admits it (`lws_admitted`: three variables put first in every container).

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
`<name>-<5 random characters>`, a StatefulSet's `<name>-<ordinal>`), and what decides what
runs in it is exactly its owner's pod template's (issue 50: a pod that copied only the vllm
container and swapped the agent-install init container for one writing a fake agent moved a
budget to the floor). What is compared, by `template_fingerprint`:

- the pod's restartPolicy, shareProcessNamespace, hostPID and hostIPC;
- the containers rankguard renders, by name: `vllm` and the `rankguard-agent-install` init
  container (how the agent gets into the pod), and any other container, init or not, that
  mounts a volume one of those two mounts (an extra init container that overwrites the agent
  in `rankguard-agent`); each in its list's order, with its image, command, args, env,
  envFrom, workingDir, restartPolicy, lifecycle hooks, exec probes and volume mounts (all but
  those at or below /var/run/secrets, where the service-account token and injected
  credentials go and nothing runs from);
- the volumes those containers mount (the volume behind the agent's path among them);
- their resources: each quantity the template sets must be the pod's.

Admission may change a real pod and not its template, and must not make it untrusted: the
API server defaults a pod and a template alike; a LimitRange only adds quantities the template
leaves unset (so resources are compared by the template's items, and a pod may carry more);
an injected sidecar, its volumes and its init containers are not compared unless they mount
rankguard's containers' volumes; the service-account token's mount is never compared. A
webhook that edits what is compared (the vllm container's env, say) makes every real pod
`not-from-template`: the PodIgnored Event says so. Computed the same way on both sides, the
fingerprint lets the edge keep a few dozen characters per ReplicaSet and per pod, not their
bodies (32 for the exact part, 16 per resource item: `fits`). (docs/security.md: an
admission policy that stops the forged pod from being created or patched at all, and the
termination rule of core/step/trust: a pod's ended run counts only when the pod was trusted
before it ended.)

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
from rankguard_operator.core.names import (
    AGENT_INIT_CONTAINER,
    LWS_GROUP_SIZE_ENV,
    LWS_KIND,
    LWS_LEADER_ADDRESS_ENV,
    LWS_WORKER_INDEX_ENV,
    VLLM_CONTAINER,
)

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
# What a pod must share with its owner's template, compared exactly (module doc: the rule).
# The pod's own fields that decide what its containers run or can reach in one another.
_POD_COMPARED = ("restartPolicy", "shareProcessNamespace", "hostPID", "hostIPC")
# A compared container's fields that decide what it runs (a native sidecar's restartPolicy
# keeps it running beside the others; a hook or an exec probe runs a command in it).
_COMPARED = ("image", "command", "args", "env", "envFrom", "workingDir", "restartPolicy", "lifecycle")
_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# Where the API server's ServiceAccount admission mounts the token, and injectors their
# credentials: mounts at or below it are not compared (no code runs from there).
_CREDENTIALS_PATH = "/var/run/secrets"
# The containers rankguard renders, compared whether or not they mount one of its volumes.
_RENDERED_CONTAINERS = frozenset((VLLM_CONTAINER, AGENT_INIT_CONTAINER))
# A resource item the template sets (a LimitRange may add the ones it does not): in the
# fingerprint as the first 16 hex digits of its digest, after the exact part's 32.
_ITEM_DIGITS = 16
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
    """A digest of what decides what runs in a pod (module doc: what is compared), as the API
    server stores it, computed for the template and for the pod alike: 32 hex digits of the
    exact part, then `:` and 16 per resource item, sorted (`fits` compares two). "" when there
    is no vllm container (matches nothing)."""
    spec = pod_spec if isinstance(pod_spec, Mapping) else {}
    lists = {
        kind: [c for c in spec.get(kind) or [] if isinstance(c, Mapping) and c.get("name")]
        for kind in ("initContainers", "containers")
    }
    if not any(c.get("name") == VLLM_CONTAINER for c in lists["containers"]):
        return ""
    # the volumes rankguard's containers mount; any container mounting one is compared too
    # (an extra init container that writes another agent into rankguard-agent, say)
    shared = {
        m["name"]
        for c in (*lists["initContainers"], *lists["containers"])
        if c.get("name") in _RENDERED_CONTAINERS
        for m in _mounts(c)
    }
    doc: dict[str, Any] = {k: spec.get(k) or None for k in _POD_COMPARED}
    items: set[str] = set()
    mounted: set[str] = set()
    for kind, containers in lists.items():
        # in their order: init containers run one after the other, the last write wins
        compared = [
            c
            for c in containers
            if c.get("name") in _RENDERED_CONTAINERS or any(m["name"] in shared for m in _mounts(c))
        ]
        doc[kind] = [_container(c) for c in compared]
        for c in compared:
            mounted.update(m["name"] for m in _mounts(c))
            items.update(_resource_items(kind, c))
    doc["volumes"] = {
        str(v["name"]): {k: x for k, x in v.items() if k != "name"}
        for v in spec.get("volumes") or []
        if isinstance(v, Mapping) and v.get("name") in mounted
    }
    exact = hashlib.sha256(_canonical(doc).encode()).hexdigest()[:32]
    digests = sorted(hashlib.sha256(i.encode()).hexdigest()[:_ITEM_DIGITS] for i in items)
    return ":".join((exact, *digests))


def fits(pod: str, template: str) -> bool:
    """A pod's fingerprint fits its owner's template's: the same exact part, and every resource
    item the template sets (the pod may carry more: a LimitRange's defaults)."""
    if not pod or not template:
        return False
    pod_exact, *pod_items = pod.split(":")
    template_exact, *template_items = template.split(":")
    return pod_exact == template_exact and set(template_items) <= set(pod_items)


def _canonical(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))  # ASCII: any string encodes


def _mounts(container: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The container's volume mounts that are compared: all but credentials' (_CREDENTIALS_PATH)."""
    out = []
    for m in container.get("volumeMounts") or []:
        if not isinstance(m, Mapping) or not m.get("name"):
            continue
        path = str(m.get("mountPath") or "").rstrip("/")
        if path == _CREDENTIALS_PATH or path.startswith(f"{_CREDENTIALS_PATH}/"):
            continue
        out.append(m)
    return out


def _container(c: Mapping[str, Any]) -> dict[str, Any]:
    # an absent field and an empty one are the same to the kubelet (and to the API server's
    # JSON, which omits empty fields)
    doc = {k: c.get(k) or None for k in _COMPARED}
    doc["name"] = c.get("name")
    # an exec probe runs its command in the container; an httpGet one (which a service mesh
    # rewrites to go through its proxy) runs nothing
    doc["probes"] = {p: c[p]["exec"] for p in _PROBES if isinstance(c.get(p), Mapping) and c[p].get("exec")}
    doc["mounts"] = sorted(_canonical(m) for m in _mounts(c))
    return doc


def _resource_items(kind: str, c: Mapping[str, Any]) -> set[str]:
    """`<kind>/<container>/<requests|limits>/<resource>=<quantity>` for each quantity set."""
    resources = c.get("resources")
    out: set[str] = set()
    if not isinstance(resources, Mapping):
        return out
    for part in ("requests", "limits"):
        quantities = resources.get(part)
        for resource, quantity in quantities.items() if isinstance(quantities, Mapping) else ():
            out.add(_canonical([kind, c.get("name"), part, resource, quantity]))
    return out


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
    "what is compared (the vllm or rankguard-agent-install container's command, args, env or "
    "mounts, the volumes they mount, a resource the template sets, or the restartPolicy): exclude "
    "the serving namespace from that webhook, or the service's pods are never trusted "
    "(docs/security.md)"
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
    statefulsets: Sequence[Mapping[str, Any]],
    service_uid: str,
    *,
    leader_worker_set: Mapping[str, Any] | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
) -> list[Mapping[str, Any]]:
    """The StatefulSets of the LLMService with `service_uid`: those it controls, its
    LeaderWorkerSet's leader set, and the worker sets whose controller is a leader pod among
    `pods` (pass the trusted ones: a set under a pod that is not the service's is not either)."""
    makers = _makers(statefulsets, service_uid, leader_worker_set, earlier={}, trusted_leaders=pods)
    return [s for s in statefulsets if _uid(s) in makers]


@dataclass(frozen=True)
class _Lws:
    """The service's LeaderWorkerSet, as far as the owner chain reads it."""

    uid: str
    name: str
    namespace: str
    size: int
    shared_subdomain: bool  # networkConfig.subdomainPolicy Shared: one headless Service, the LWS's


def _owned_lws(lws: Mapping[str, Any] | None, service_uid: str) -> _Lws | None:
    """The LeaderWorkerSet when the LLMService with `service_uid` is its controller."""
    if lws is None or not service_uid or controller_of(lws) != ("LLMService", service_uid):
        return None
    meta, spec = lws.get("metadata") or {}, lws.get("spec") or {}
    size = (spec.get("leaderWorkerTemplate") or {}).get("size")
    policy = (spec.get("networkConfig") or {}).get("subdomainPolicy")
    return _Lws(
        uid=str(meta.get("uid") or ""),
        name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or ""),
        size=size if isinstance(size, int) and not isinstance(size, bool) else 1,
        # Shared is LWS's default (its webhook writes it when networkConfig is absent)
        shared_subdomain=policy != "UniquePerReplica",
    )


def lws_admitted(
    template_spec: Mapping[str, Any] | None,
    *,
    lws_name: str,
    namespace: str,
    subdomain: str,
    group: int,
    worker: int,
    size: int,
) -> dict[str, Any]:
    """A pod spec as LWS's pod webhook admits a pod made from `template_spec` (lws v0.9.0
    pkg/utils/pod AddLWSVariables, unchanged at v0.10.0): in every container and init container
    LWS_LEADER_ADDRESS (`<lws>-<group>.<subdomain>.<namespace>`), LWS_GROUP_SIZE and
    LWS_WORKER_INDEX come first, and a container's own variable of one of those names goes."""
    injected = [
        {"name": LWS_LEADER_ADDRESS_ENV, "value": f"{lws_name}-{group}.{subdomain}.{namespace}"},
        {"name": LWS_GROUP_SIZE_ENV, "value": str(size)},
        {"name": LWS_WORKER_INDEX_ENV, "value": str(worker)},
    ]
    names = {e["name"] for e in injected}
    spec: dict[str, Any] = dict(template_spec or {})
    for key in ("containers", "initContainers"):
        listed = spec.get(key)
        if not isinstance(listed, list):
            continue
        spec[key] = [
            {
                **c,
                "env": [
                    *injected,
                    *(
                        e
                        for e in c.get("env") or []
                        if not (isinstance(e, Mapping) and e.get("name") in names)
                    ),
                ],
            }
            if isinstance(c, Mapping)
            else c
            for c in listed
        ]
    return spec


@dataclass(frozen=True)
class _Maker:
    """A StatefulSet that vouches for pods: its name, and what its pods' specs must be."""

    name: str
    templates: frozenset[str] = frozenset()  # rankguard's own set: the fingerprints it vouches for
    # LWS's sets: the pod templates its pods are admitted from (its own, then the ones it carried
    # before: LWS rolls a set's template while its old pods still run), the LWS, and for a worker
    # set its group (a leader set's pod ordinal is its group)
    specs: tuple[Mapping[str, Any] | None, ...] = ()
    lws: _Lws | None = None
    group: int | None = None

    def named(self, pod_name: str) -> bool:
        """The StatefulSet controller's name for the pod (a worker set's ordinals start at 1)."""
        if not named_by_statefulset(pod_name, self.name):
            return False
        return self.group is None or _ordinal(pod_name, self.name) >= 1

    def fingerprints(self, pod_name: str) -> Collection[str]:
        """The fingerprints the pod `pod_name` (named by this set) may have."""
        if self.lws is None:
            return self.templates
        lws, ordinal = self.lws, _ordinal(pod_name, self.name)
        group, worker = (ordinal, 0) if self.group is None else (self.group, ordinal)
        # the StatefulSet controller sets a pod's subdomain to its set's serviceName, and LWS's
        # webhook a leader's to its own name under UniquePerReplica: the group's Service, named
        # after the leader, either way
        subdomain = lws.name if lws.shared_subdomain else f"{lws.name}-{group}"
        return tuple(
            template_fingerprint(
                lws_admitted(
                    spec,
                    lws_name=lws.name,
                    namespace=lws.namespace,
                    subdomain=subdomain,
                    group=group,
                    worker=worker,
                    size=lws.size,
                )
            )
            for spec in self.specs
        )


def _ordinal(pod_name: str, set_name: str) -> int:
    return int(pod_name[len(set_name) + 1 :])


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")


def _makers(
    statefulsets: Sequence[Mapping[str, Any]],
    service_uid: str,
    leader_worker_set: Mapping[str, Any] | None,
    *,
    earlier: Mapping[str, Collection[str]],
    trusted_leaders: Sequence[Mapping[str, Any]],
    earlier_specs: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, _Maker]:
    """StatefulSet UID -> _Maker, for the sets on the service's owner chain: its own, its
    LeaderWorkerSet's leader set, and the worker sets whose controller is one of
    `trusted_leaders` that the leader set made (a pod, by UID and name)."""
    lws = _owned_lws(leader_worker_set, service_uid)
    makers: dict[str, _Maker] = {}
    leader_sets: set[str] = set()
    for s in statefulsets:
        uid, name = _uid(s), str((s.get("metadata") or {}).get("name") or "")
        owner = controller_of(s)
        template = ((s.get("spec") or {}).get("template") or {}).get("spec")
        if service_uid and owner == ("LLMService", service_uid):
            makers[uid] = _Maker(name, frozenset({statefulset_fingerprint(s), *earlier.get(uid, ())}))
        elif lws is not None and owner == (LWS_KIND, lws.uid) and name == lws.name:
            makers[uid] = _Maker(name, specs=(template, *(earlier_specs or {}).get(uid, ())), lws=lws)
            leader_sets.add(uid)
    leaders = {
        _uid(p): str((p.get("metadata") or {}).get("name") or "")
        for p in trusted_leaders
        if (controller_of(p) or ("", ""))[1] in leader_sets
    }
    for s in statefulsets:
        uid, name = _uid(s), str((s.get("metadata") or {}).get("name") or "")
        owner = controller_of(s)
        if lws is not None and owner is not None and owner[0] == "Pod" and leaders.get(owner[1]) == name:
            template = ((s.get("spec") or {}).get("template") or {}).get("spec")
            specs = (template, *(earlier_specs or {}).get(uid, ()))
            makers[uid] = _Maker(name, specs=specs, lws=lws, group=_ordinal(name, lws.name))
    return makers


def statefulset_fingerprint(statefulset: Mapping[str, Any]) -> str:
    """The template_fingerprint of a StatefulSet's pod template."""
    return template_fingerprint(((statefulset.get("spec") or {}).get("template") or {}).get("spec"))


def _provenance(pod: Mapping[str, Any], named: bool, templates: Collection[str]) -> IgnoredReason | None:
    """Why a pod with a good owner chain is still not its owner's: its name, then its spec."""
    if not named:
        return "wrong-name"
    fingerprint = pod_fingerprint(pod)
    if not any(fits(fingerprint, t) for t in templates):
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
    leader_worker_set: Mapping[str, Any] | None = None,
    earlier_set_specs: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> tuple[list[Mapping[str, Any]], list[Ignored]]:
    """Split `pods` (found by rankguard's labels) into those whose owner chain leads to the
    LLMService and that their owner made (name and template), and those to ignore.

    `replicasets`: ReplicaSet UID -> ReplicaSetRef, for the ReplicaSets carrying rankguard's
    labels. `statefulsets`: the StatefulSets carrying rankguard's labels (a multi-node
    service's groups) and those of its LeaderWorkerSet (`leader_worker_set`, as the watch
    delivers it). `earlier_set_templates`: StatefulSet UID -> fingerprints of templates
    that set carried before (a group replace applies the new template at zero replicas while
    the old pods still terminate, and a group must not look empty before they are gone).
    `earlier_set_specs`: the same for LWS's sets, as pod template specs (what LWS's webhook
    admits from a template depends on the pod: lws_admitted)."""
    earlier = earlier_set_templates or {}
    # Two rounds: a worker set vouches for its pods only once its controller, a leader pod, is
    # itself vouched for by the leader set (the chain's links are checked in order).
    makers = _makers(
        statefulsets,
        service_uid,
        leader_worker_set,
        earlier=earlier,
        trusted_leaders=(),
        earlier_specs=earlier_set_specs,
    )

    def judge(makers: Mapping[str, _Maker]) -> tuple[list[Mapping[str, Any]], list[Ignored]]:
        return _judge(
            pods,
            replicasets=replicasets,
            deployment=deployment,
            service_uid=service_uid,
            statefulsets=statefulsets,
            makers=makers,
        )

    leaders, _ = judge(makers)
    if leader_worker_set is not None:
        makers = _makers(
            statefulsets,
            service_uid,
            leader_worker_set,
            earlier=earlier,
            trusted_leaders=leaders,
            earlier_specs=earlier_set_specs,
        )
    return judge(makers)


def _judge(
    pods: Sequence[Mapping[str, Any]],
    *,
    replicasets: Mapping[str, ReplicaSetRef],
    deployment: Mapping[str, Any] | None,
    service_uid: str,
    statefulsets: Sequence[Mapping[str, Any]],
    makers: Mapping[str, _Maker],
) -> tuple[list[Mapping[str, Any]], list[Ignored]]:
    deployment_uid = owned_deployment_uid(deployment, service_uid)
    watched = {_uid(s) for s in statefulsets}
    trusted: list[Mapping[str, Any]] = []
    ignored: list[Ignored] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        name, uid = str(meta.get("name") or ""), str(meta.get("uid") or "")
        owner = controller_of(pod)
        reason: IgnoredReason | None
        if owner is not None and owner[0] == "StatefulSet":
            if owner[1] in makers:
                maker = makers[owner[1]]
                named = maker.named(name)
                reason = _provenance(pod, named, maker.fingerprints(name) if named else ())
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
