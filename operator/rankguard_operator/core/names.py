"""Names, labels and annotations of what rankguard renders, within Kubernetes' limits.

An LLMService name is a DNS subdomain (up to 253 characters, dots allowed, may start with a
digit). What rankguard derives from it must fit stricter rules: a label value is at most 63
characters, and a Service name is a DNS-1035 label (63 characters, a letter first, no dots).
Each derived value is the name itself when it fits, else a readable prefix plus a hash of the
full name, so two services never share one. The pod index is keyed by the label value
(`label_value`), and everything that looks pods up uses the same function.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

API_GROUP = "rankguard.io"
API_VERSION = "v1alpha1"
PLURAL = "llmservices"
OWNER_API_VERSION = f"{API_GROUP}/{API_VERSION}"
OWNER_KIND = "LLMService"

VLLM_CONTAINER = "vllm"
AGENT_INIT_CONTAINER = "rankguard-agent-install"
AGENT_VOLUME = "rankguard-agent"
AGENT_MOUNT_PATH = "/opt/rankguard/agent"
# The agent image the init container copies the bundle from, unless the operator is told
# another (RANKGUARD_AGENT_IMAGE, the chart's agent.image) or the spec names one.
DEFAULT_AGENT_IMAGE = "ghcr.io/rankguard/agent:0.1.0"
# The agent bundle's stdlib-only entry: run by path, so no PYTHONPATH leaks into vLLM, and it
# starts vLLM anyway when the agent itself cannot start.
AGENT_ENTRY = f"{AGENT_MOUNT_PATH}/rankguard-agent"
SHM_VOLUME = "dshm"
SHM_MOUNT_PATH = "/dev/shm"
CACHE_VOLUME = "model-cache"
TERMINATION_LOG = "/dev/termination-log"
VLLM_HTTP_PORT = 8000
GPU_RESOURCE = "nvidia.com/gpu"  # the default of spec.resources.gpuResourceName

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "rankguard"
LLMSERVICE_LABEL = f"{API_GROUP}/llmservice"
TEMPLATE_HASH_ANNOTATION = f"{API_GROUP}/template-hash"
FLAGS_ANNOTATION = f"{API_GROUP}/serving-flags"
# On the Deployment (never its pod template): the remediation a roll carried out.
REMEDIATION_ID_ANNOTATION = f"{API_GROUP}/remediation-id"

_MAX_LABEL = 63
_MAX_SUBDOMAIN = 253
# The Deployment is named after the LLMService and its ReplicaSets add "-<pod-template hash>"
# (up to 10 characters) within 253; the CRD refuses longer names with the same bound.
MAX_NAME = _MAX_SUBDOMAIN - 11
_HASH_CHARS = 8
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:_HASH_CHARS]


def with_hash(text: str, limit: int, full_name: str) -> str:
    """`text` cut so that `-<hash of full_name>` fits `limit` characters, ending alphanumeric: how
    every name rankguard derives is shortened (the hash keeps two long names apart)."""
    head = text[: limit - _HASH_CHARS - 1].rstrip("-.")
    return f"{head}-{_digest(full_name)}" if head else _digest(full_name)


def _shorten(text: str, full_name: str) -> str:
    return with_hash(text, _MAX_LABEL, full_name)


def label_value(name: str) -> str:
    """The LLMService's name as a label value: itself up to 63 characters, else shortened with a
    hash. The pods carry it and the pod index is keyed by it."""
    return name if len(name) <= _MAX_LABEL else _shorten(name, name)


def service_name(name: str) -> str:
    """A valid Service name (DNS-1035 label) for the LLMService `name`: the name itself when it
    is one, else a letter-first, dot-free form with a hash of the full name."""
    if _DNS1035.match(name) and len(name) <= _MAX_LABEL:
        return name
    text = name.replace(".", "-")
    if not text[:1].isalpha():
        text = f"svc-{text}"
    return _shorten(text, name)


def cache_claim_name(name: str) -> str:
    """The PersistentVolumeClaim rankguard creates for spec.modelCache.size: `<name>-model-cache`,
    shortened with a hash when that would exceed a DNS subdomain's 253 characters."""
    suffix = f"-{CACHE_VOLUME}"
    if len(name) + len(suffix) <= _MAX_SUBDOMAIN:
        return name + suffix
    head = name[: _MAX_SUBDOMAIN - len(suffix) - _HASH_CHARS - 1].rstrip("-.")
    return f"{head}-{_digest(name)}{suffix}"


def name_problem(name: str) -> str | None:
    """Why an LLMService cannot be served under `name` (an operator running against an older
    CRD, which did not refuse it at apply), or None."""
    if len(name) > MAX_NAME:
        return (
            f"metadata.name is {len(name)} characters, longer than {MAX_NAME}: the serving "
            "Deployment's ReplicaSets are named after it plus an 11-character suffix, which must "
            "fit 253. Re-create the LLMService under a shorter name"
        )
    return None


def labels(name: str) -> dict[str, str]:
    """Labels on the Deployment, its pods and the Service."""
    value = label_value(name)
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": value,
        MANAGED_BY_LABEL: MANAGED_BY,
        LLMSERVICE_LABEL: value,
    }


def selector(name: str) -> dict[str, str]:
    """The pod selector (immutable on a Deployment, so deliberately small and stable)."""
    return {"app.kubernetes.io/name": "vllm", LLMSERVICE_LABEL: label_value(name)}


def owner_reference(name: str, owner_uid: str) -> dict[str, Any]:
    """Makes the LLMService the controller of what it renders, so deleting it cascades."""
    return {
        "apiVersion": OWNER_API_VERSION,
        "kind": OWNER_KIND,
        "name": name,
        "uid": owner_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


# --------------------------------------------------------------------------------------------
# A group's objects (spec.distributed)

GROUP_LABEL = f"{API_GROUP}/group"  # which group (replica) of a multi-node service a pod serves
ROLE_LABEL = f"{API_GROUP}/role"  # leader (node rank 0, serves HTTP) or worker (headless)
# Set by the StatefulSet controller (Kubernetes >= 1.28) on each pod: its ordinal. The workers'
# StatefulSet starts its ordinals at 1, so the label is the pod's vLLM node rank.
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
NODE_RANK_ENV = "RANKGUARD_NODE_RANK"
# A StatefulSet's pods carry `statefulset.kubernetes.io/pod-name` (a label value, 63 at most)
# and `controller-revision-hash` (the set's name, "-" and up to 10 characters): the set's name
# plus "-w-" and two ordinal digits must stay within that.
_GROUP_BASE = _MAX_LABEL - 11 - 6


def group_base(name: str) -> str:
    """The stem of a multi-node service's StatefulSets and Services: its Service name, cut with a
    hash so `<stem>-g<i>-w-<ordinal>` stays a DNS label."""
    base = service_name(name)
    if len(base) <= _GROUP_BASE:
        return base
    return with_hash(base, _GROUP_BASE, name)


def group_leader_name(name: str, group: int) -> str:
    """The leader StatefulSet of group `group`; its one pod is `<this>-0`."""
    return f"{group_base(name)}-g{group}"


def group_workers_name(name: str, group: int) -> str:
    """The workers' StatefulSet of group `group`; its pods are `<this>-1` … `<this>-<N-1>`."""
    return f"{group_base(name)}-g{group}-w"


def group_service_name(name: str) -> str:
    """The headless Service that gives every pod of every group its DNS name (the leader's is the
    rendezvous address)."""
    return f"{group_base(name)}-nodes"


# What the LeaderWorkerSet controller (kubernetes-sigs/lws, api/leaderworkerset/v1) names and
# labels: here, below render and observe, because both read them (render writes the LWS, observe
# follows its StatefulSets and pods back to it).
LWS_KIND = "LeaderWorkerSet"
LWS_SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE_ENV = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"


# The LWS name must be a DNS-1035 label (LWS's webhook) and leave room for what LWS derives
# from it: the workers' StatefulSet `<lws>-<group>` puts `controller-revision-hash:
# <lws>-<group>-<hash of up to 10>` on its pods, a label value of at most 63 characters, and
# `<lws>-<group>` is also the group's headless Service. With groups numbered up to 4 digits:
# 63 - len("-9999") - len("-") - 10 = 47.
MAX_LWS_NAME = 47


def lws_name(name: str) -> str:
    """The LeaderWorkerSet's name for the LLMService `name`: its Service name (a DNS-1035
    label), cut to MAX_LWS_NAME with a hash of the full name when longer."""
    base = service_name(name)
    if len(base) <= MAX_LWS_NAME:
        return base
    return with_hash(base, MAX_LWS_NAME, name)


def group_labels(name: str, group: int, role: str) -> dict[str, str]:
    return {**labels(name), GROUP_LABEL: str(group), ROLE_LABEL: role}


def group_selector(name: str, group: int, role: str) -> dict[str, str]:
    return {**selector(name), GROUP_LABEL: str(group), ROLE_LABEL: role}
