"""The LeaderWorkerSet of a multi-node group (`spec.distributed.workload: LeaderWorkerSet`).

One `leaderworkerset.x-k8s.io/v1` LeaderWorkerSet per LLMService: `spec.replicas` groups of
`leaderWorkerTemplate.size` pods each. Pod 0 of a group (the leader) serves HTTP; the others run
`vllm serve … --headless --node-rank i`. The group renderer builds both pod templates (metadata
and spec, vLLM's command lines included); this module only wraps them. The API is the one of
kubernetes-sigs/lws v0.10.0, vendored in third_party/lws/ and checked by the cluster tier
(tests/cluster/test_lws_dry_run.py); the webhook's own rules are `lws_rules.lws_problems`.

What LWS does for us, so rankguard does not:

- **Group restart** (`restartPolicy: RecreateGroupOnPodRestart`): a pod recreated, or any of its
  containers restarted, and LWS recreates every pod of that group: a vLLM group whose one rank
  died cannot heal in place (torch.distributed has no rejoin), so it starts again together.
- **Leader first** (`startupPolicy: LeaderCreated`): the workers' StatefulSet of a group is
  created once its leader pod exists, so the leader's DNS name is there for the workers'
  `--master-addr`.
- **Rolling by group** (`rolloutStrategy` RollingUpdate, maxUnavailable 1, maxSurge 0): a new
  template replaces one whole group at a time, never a mix of old and new ranks in one group.
- **Names and DNS** (`networkConfig.subdomainPolicy: UniquePerReplica`): leaders are pods
  `<lws>-<group>`, workers `<lws>-<group>-<rank>`, and each group gets a headless Service named
  after its leader. Not Shared: a Shared LWS creates one headless Service named `<lws>`, which
  is the name of rankguard's own HTTP Service; LWS would find ours and make no headless one
  (its CreateHeadlessServiceIfNotExists), and no leader address would resolve.

What LWS (v0.10.0) injects, at pod admission (its pod webhook):

- env, first in every container and init container: `LWS_LEADER_ADDRESS`
  (`<lws>-<group>.<subdomain>.<namespace>`, the leader's DNS name), `LWS_GROUP_SIZE` (size),
  `LWS_WORKER_INDEX` (0 for the leader, 1..size-1 for workers). A container's own variable of
  the same name is dropped.
- labels: `leaderworkerset.sigs.k8s.io/name`, `…/group-index`, `…/worker-index` (the leader's
  "0" is in its StatefulSet's template, a worker's is set at admission), `…/group-key`,
  `…/template-revision-hash`; annotations `…/size`, `…/leader-name` (workers) and
  `…/subdomainPolicy` (leaders, under UniquePerReplica).

So a pod's vLLM node rank is its worker-index label, read through the downward API
(`node_rank_env`: RANKGUARD_NODE_RANK), and a worker's `--master-addr` is
`$(LWS_LEADER_ADDRESS)` (`MASTER_ADDR_ARG`).

Pure: no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.names import (
    LWS_GROUP_INDEX_LABEL,
    LWS_GROUP_SIZE_ENV,
    LWS_KIND,
    LWS_LEADER_ADDRESS_ENV,
    LWS_SET_NAME_LABEL,
    LWS_WORKER_INDEX_ENV,
    LWS_WORKER_INDEX_LABEL,
    NODE_RANK_ENV,
    lws_name,
    owner_reference,
)

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_PLURAL = "leaderworkersets"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"

# api/leaderworkerset/v1/leaderworkerset_types.go at v0.10.0 (the same in v0.9.0, the controller
# the tests run: hack/testbin/build.sh); the ones observe reads too live in core/names
LEADER_ADDRESS_ENV = LWS_LEADER_ADDRESS_ENV
GROUP_SIZE_ENV = LWS_GROUP_SIZE_ENV
WORKER_INDEX_ENV = LWS_WORKER_INDEX_ENV
SET_NAME_LABEL = LWS_SET_NAME_LABEL
GROUP_INDEX_LABEL = LWS_GROUP_INDEX_LABEL
WORKER_INDEX_LABEL = LWS_WORKER_INDEX_LABEL
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
TEMPLATE_REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"
SUBDOMAIN_POLICY_ANNOTATION = "leaderworkerset.sigs.k8s.io/subdomainPolicy"

RESTART_POLICY = "RecreateGroupOnPodRestart"
STARTUP_POLICY = "LeaderCreated"
SUBDOMAIN_POLICY = "UniquePerReplica"

MASTER_ADDR_ARG = f"$({LEADER_ADDRESS_ENV})"


def node_rank_env() -> dict[str, Any]:
    """RANKGUARD_NODE_RANK: the pod's rank in its group, from LWS's worker-index label."""
    return {
        "name": NODE_RANK_ENV,
        "valueFrom": {
            "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{WORKER_INDEX_LABEL}']"}
        },
    }


def render_leader_worker_set(
    name: str,
    namespace: str,
    owner_uid: str,
    *,
    replicas: int,
    size: int,
    leader_template: dict[str, Any],
    worker_template: dict[str, Any],
    labels: Mapping[str, str],
    revision_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The LeaderWorkerSet for the LLMService `name` (uid `owner_uid`, its controller):
    `replicas` groups of `size` pods, the leader's and the workers' pod templates copied in
    as given. `labels` go on the LeaderWorkerSet (LWS hands them on to its StatefulSets);
    `revision_annotations` on it too, never on the pod templates (a change there would roll
    every group). Raises ValueError for a size below 1 or negative replicas."""
    if size < 1:
        raise ValueError(f"a group has at least one pod (its leader), not {size}")
    if replicas < 0:
        raise ValueError(f"replicas must not be negative, not {replicas}")
    metadata: dict[str, Any] = {
        "name": lws_name(name),
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [owner_reference(name, owner_uid)],
    }
    if revision_annotations:
        metadata["annotations"] = dict(revision_annotations)
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": STARTUP_POLICY,
            "rolloutStrategy": {
                "type": "RollingUpdate",
                # partition is left to LWS's default (0) and to whoever sets it for a canary
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": SUBDOMAIN_POLICY},
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": copy.deepcopy(leader_template),
                "workerTemplate": copy.deepcopy(worker_template),
            },
        },
    }
