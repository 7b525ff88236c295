"""Register a Node and keep it alive the way a kubelet does (Ready condition + Lease renewals).

Without these the node-lifecycle controller keeps the `node.kubernetes.io/not-ready`
taint on the Node and the scheduler never binds a Pod to it.
"""

from __future__ import annotations

import datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def node_status(gpus: int, memory: str, cpu: str, address: str) -> dict[str, Any]:
    now = _now().isoformat()
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "rankguard process kubelet is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            },
            *[
                {
                    "type": t,
                    "status": "False",
                    "reason": f"KubeletHas{r}",
                    "message": "",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
                for t, r in (
                    ("MemoryPressure", "SufficientMemory"),
                    ("DiskPressure", "NoDiskPressure"),
                    ("PIDPressure", "SufficientPID"),
                )
            ],
        ],
        "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": address}],
        "nodeInfo": {
            "architecture": "amd64",
            "bootID": "",
            "containerRuntimeVersion": "rankguard-process://0.1.0",
            "kernelVersion": "",
            "kubeProxyVersion": "",
            "kubeletVersion": "v1.34.4",
            "machineID": "",
            "operatingSystem": "linux",
            "osImage": "rankguard sandbox",
            "systemUUID": "",
        },
    }


def register_node(
    api: client.ApiClient,
    name: str,
    *,
    gpus: int = 8,
    memory: str = "512Gi",
    cpu: str = "64",
    address: str = "127.0.0.1",
    labels: dict[str, str] | None = None,
) -> None:
    """Create (or take over) the Node and mark it Ready, then renew its Lease."""
    core = client.CoreV1Api(api)
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "nvidia.com/gpu.present": "true",
                **(labels or {}),
            },
        },
    }
    try:
        core.create_node(body)
    except ApiException as e:
        if e.status != 409:
            raise
    core.patch_node_status(name, {"status": node_status(gpus, memory, cpu, address)})
    heartbeat(api, name)


def heartbeat(api: client.ApiClient, name: str) -> None:
    """Renew the node's Lease and refresh its Ready condition (call every few seconds)."""
    coord = client.CoordinationV1Api(api)
    now = _now()
    spec = {
        "holderIdentity": name,
        "leaseDurationSeconds": LEASE_SECONDS,
        "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }
    try:
        coord.patch_namespaced_lease(name, LEASE_NAMESPACE, {"spec": spec})
    except ApiException as e:
        if e.status != 404:
            raise
        coord.create_namespaced_lease(
            LEASE_NAMESPACE,
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name},
                "spec": spec,
            },
        )
    core = client.CoreV1Api(api)
    node = core.read_node_status(name)
    conditions = []
    for c in node.status.conditions or []:
        d = api.sanitize_for_serialization(c)
        d["lastHeartbeatTime"] = now.isoformat()
        conditions.append(d)
    if conditions:
        core.patch_node_status(name, {"status": {"conditions": conditions}})


def node_schedulable(api: client.ApiClient, name: str) -> bool:
    """True once the lifecycle controller has lifted the not-ready taint."""
    node = client.CoreV1Api(api).read_node(name)
    taints = node.spec.taints or []
    return not any(t.key.startswith("node.kubernetes.io/not-ready") for t in taints)
