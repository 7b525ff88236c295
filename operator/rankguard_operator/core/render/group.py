"""Renderers for a multi-node service (spec.distributed): each replica a group of pods.

Per group `i` two StatefulSets and, for the whole service, one headless Service:

* `<base>-g<i>`: the leader, one pod `<base>-g<i>-0`, node rank 0, serving HTTP with the probes;
* `<base>-g<i>-w`: the workers, `spec.ordinals.start: 1`, pods `<base>-g<i>-w-1` … `-<N-1>`,
  each running `--headless --node-rank <its pod-index label>`;
* `<base>-nodes`: headless (`clusterIP: None`), `publishNotReadyAddresses: true` (the leader's
  name must resolve while it waits for the workers, long before it is ready), selecting every
  group's pods, and named as each StatefulSet's `serviceName`, so the leader is
  `<base>-g<i>-0.<base>-nodes.<namespace>`: the workers' `--master-addr`.

Why two sets a group and not one (or one for the whole service with ordinal arithmetic,
docs/architecture.md): the leader and the workers run different command lines and probes, and
a StatefulSet has one template; the workers' ordinals starting at 1 make the pod-index label
the node rank, with nothing computed in the pod. Both sets use `podManagementPolicy: Parallel`
(vLLM's rendezvous needs every node up at once) and `updateStrategy: OnDelete`: rankguard,
not the StatefulSet controller, decides when a group's pods are replaced, and replaces them all
together (core/step/group_roll), so no group ever runs two templates at once.

The template hash is the hash of group 0's two templates, stamped on every group's (the groups
differ only in their index), so a pod says which render it came from, whatever its group.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.hf_config import canonical_json
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.names import (
    FLAGS_ANNOTATION,
    POD_INDEX_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    group_labels,
    group_leader_name,
    group_selector,
    group_service_name,
    group_workers_name,
    labels,
    owner_reference,
    selector,
)
from rankguard_operator.core.render.leader_worker_set import (
    MASTER_ADDR_ARG,
    WORKER_INDEX_LABEL,
    render_leader_worker_set,
)
from rankguard_operator.core.render.pod import GroupNode, pod_spec
from rankguard_operator.core.spec.distributed import DistributedSpec
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.spec.template import apply_template

LEADER, WORKER = "leader", "worker"
# The kind of the in-memory document the step compares and rolls with (never applied as such).
GROUP_SET_KIND = "GroupSet"


@dataclass(frozen=True)
class GroupInputs:
    """What every pod template of the service is rendered from, besides its group and role."""

    spec: ServiceSpec
    flags: ServingFlags
    agent_image: str
    plan: Plan | None
    startup_free_bytes: int | None = None
    external_weight_bytes: int | None = None
    shape: ModelShape | None = None


def leader_address(name: str, namespace: str, group: int) -> str:
    """The leader pod's DNS name within the cluster (the search path adds `svc.<domain>`)."""
    return f"{group_leader_name(name, group)}-0.{group_service_name(name)}.{namespace}"


def _node(d: DistributedSpec, role: str, master_addr: str, rank_label: str | None) -> GroupNode:
    return GroupNode(
        nnodes=d.pods_per_group,
        role="leader" if role == LEADER else "worker",
        master_addr=master_addr,
        master_port=d.rendezvous_port,
        timeout_seconds=d.timeout_seconds,
        network_interface=d.network_interface,
        node_rank_label=None if role == LEADER else rank_label,
    )


def pod_template(
    name: str,
    inputs: GroupInputs,
    role: str,
    pod_labels: Mapping[str, str],
    *,
    master_addr: str,
    rank_label: str,
) -> dict[str, Any]:
    """One role's pod template (metadata and spec), the user's templates merged, no hash yet."""
    spec = inputs.spec
    assert spec.distributed is not None
    template: dict[str, Any] = {
        "metadata": {
            "labels": dict(pod_labels),
            "annotations": {FLAGS_ANNOTATION: canonical_json(inputs.flags.to_status())},
        },
        "spec": pod_spec(
            name,
            spec,
            inputs.flags,
            inputs.agent_image,
            inputs.plan,
            startup_free_bytes=inputs.startup_free_bytes,
            external_weight_bytes=inputs.external_weight_bytes,
            shape=inputs.shape,
            node=_node(spec.distributed, role, master_addr, rank_label),
        ),
    }
    apply_template(spec.template, template["metadata"], template["spec"])
    if role == WORKER and spec.distributed.worker_template != "{}":
        apply_worker_overrides(spec.distributed.worker_overrides, template)
    return template


def apply_worker_overrides(overrides: Mapping[str, Any], template: dict[str, Any]) -> None:
    """spec.distributed.workerTemplate over a worker's template: labels and annotations added,
    the node selector's keys set, tolerations appended."""
    meta = overrides.get("metadata") or {}
    tmeta = template["metadata"]
    tmeta["labels"] = {**meta.get("labels", {}), **tmeta.get("labels", {})}
    tmeta["annotations"] = {**meta.get("annotations", {}), **tmeta.get("annotations", {})}
    pod = overrides.get("spec") or {}
    tspec = template["spec"]
    if "nodeSelector" in pod:
        tspec["nodeSelector"] = {**tspec.get("nodeSelector", {}), **pod["nodeSelector"]}
    if "tolerations" in pod:
        tspec["tolerations"] = [*tspec.get("tolerations", []), *pod["tolerations"]]


def _stamp(templates: list[dict[str, Any]], digest: str) -> None:
    for t in templates:
        t["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = digest


def templates_hash(leader: Mapping[str, Any], worker: Mapping[str, Any]) -> str:
    """16 hex digits over both templates: equal for equal renders."""
    return hashlib.sha256(canonical_json([leader, worker]).encode()).hexdigest()[:16]


def _statefulset(
    name: str,
    namespace: str,
    owner_uid: str,
    *,
    group: int,
    role: str,
    template: dict[str, Any],
    replicas: int,
) -> dict[str, Any]:
    set_name = group_leader_name(name, group) if role == LEADER else group_workers_name(name, group)
    spec: dict[str, Any] = {
        "replicas": replicas,
        "serviceName": group_service_name(name),
        "selector": {"matchLabels": group_selector(name, group, role)},
        "podManagementPolicy": "Parallel",
        "updateStrategy": {"type": "OnDelete"},
        "revisionHistoryLimit": 10,
        "template": template,
    }
    if role == WORKER:
        spec["ordinals"] = {"start": 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": set_name,
            "namespace": namespace,
            "labels": group_labels(name, group, role),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": spec,
    }


@dataclass(frozen=True)
class Group:
    """One group's two StatefulSets as rendered (full size)."""

    index: int
    leader: dict[str, Any]
    workers: dict[str, Any]

    def scaled(self, up: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """Both sets at full size (`up`) or at zero, the group's pods all stopped."""
        leader = {**self.leader, "spec": {**self.leader["spec"], "replicas": 1 if up else 0}}
        n = self.workers["spec"]["replicas"] if up else 0
        return leader, {**self.workers, "spec": {**self.workers["spec"], "replicas": n}}


def render_group_set(
    name: str,
    namespace: str,
    owner_uid: str,
    inputs: GroupInputs,
    *,
    revision_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The service's groups as one document the step compares like a Deployment: `spec.replicas`
    (groups), `spec.template`'s hash annotation, and under `groups` every group's StatefulSets.
    Never applied as such: core/step/group_roll applies its sets, one group at a time."""
    spec = inputs.spec
    d = spec.distributed
    assert d is not None
    if d.workload == "LeaderWorkerSet":
        return _lws_group_set(name, namespace, owner_uid, inputs, revision_annotations)
    groups = []
    digest = ""
    for i in range(spec.replicas or 1):
        addr = leader_address(name, namespace, i)
        leader = pod_template(
            name, inputs, LEADER, group_labels(name, i, LEADER), master_addr=addr, rank_label=POD_INDEX_LABEL
        )
        worker = pod_template(
            name, inputs, WORKER, group_labels(name, i, WORKER), master_addr=addr, rank_label=POD_INDEX_LABEL
        )
        if i == 0:
            digest = templates_hash(leader, worker)
        _stamp([leader, worker], digest)
        sets = [
            _statefulset(name, namespace, owner_uid, group=i, role=role, template=t, replicas=n)
            for role, t, n in ((LEADER, leader, 1), (WORKER, worker, d.pods_per_group - 1))
        ]
        groups.append(Group(i, *sets))
    return _group_set(
        name, namespace, inputs, digest, revision_annotations, groups=groups if spec.replicas else []
    )


def _group_set(
    name: str,
    namespace: str,
    inputs: GroupInputs,
    digest: str,
    revision_annotations: Mapping[str, str] | None,
    *,
    groups: list[Group],
    lws: dict[str, Any] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if revision_annotations:
        meta["annotations"] = dict(revision_annotations)
    annotations = {
        TEMPLATE_HASH_ANNOTATION: digest,
        FLAGS_ANNOTATION: canonical_json(inputs.flags.to_status()),
    }
    doc: dict[str, Any] = {
        "kind": GROUP_SET_KIND,
        "metadata": meta,
        "spec": {"replicas": inputs.spec.replicas, "template": {"metadata": {"annotations": annotations}}},
        "groups": groups,
    }
    if lws is not None:
        doc["leaderWorkerSet"] = lws
    return doc


def _lws_group_set(
    name: str,
    namespace: str,
    owner_uid: str,
    inputs: GroupInputs,
    revision_annotations: Mapping[str, str] | None,
) -> dict[str, Any]:
    """The groups as one LeaderWorkerSet (render/leader_worker_set): LWS's controller starts,
    restarts and rolls them; the leader's address is the one LWS injects, a pod's node rank
    its worker-index label."""
    spec = inputs.spec
    assert spec.distributed is not None
    role_labels = {r: {**labels(name), ROLE_LABEL: r} for r in (LEADER, WORKER)}
    leader, worker = (
        pod_template(
            name, inputs, r, role_labels[r], master_addr=MASTER_ADDR_ARG, rank_label=WORKER_INDEX_LABEL
        )
        for r in (LEADER, WORKER)
    )
    digest = templates_hash(leader, worker)
    _stamp([leader, worker], digest)
    lws = render_leader_worker_set(
        name,
        namespace,
        owner_uid,
        replicas=spec.replicas,
        size=spec.distributed.pods_per_group,
        leader_template=leader,
        worker_template=worker,
        labels=labels(name),
        revision_annotations=revision_annotations,
    )
    return _group_set(name, namespace, inputs, digest, revision_annotations, groups=[], lws=lws)


def render_group_service(name: str, namespace: str, owner_uid: str) -> dict[str, Any]:
    """The headless Service every group's pods are named in (their rendezvous addresses)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": group_service_name(name),
            "namespace": namespace,
            "labels": labels(name),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(name),
            # no ports: a headless Service publishes its pods' names without any, and the
            # workers dial the leader's rendezvous port directly
        },
    }
