"""Register a Node and keep it alive the way a kubelet does (Ready condition + Lease renewals).

Without these the node-lifecycle controller keeps the `node.kubernetes.io/not-ready`
taint on the Node and the scheduler never binds a Pod to it.

The node also carries what NVIDIA GPU Feature Discovery would label it with (`gfd_labels`)
and, when it has MIG slices, their extended resources `nvidia.com/mig-<profile>`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


# ------------------------------------------------------------------------------ GPU Feature Discovery

MIB = 1 << 20


def label_value(text: str) -> str:
    """A valid label value: GFD replaces spaces with "-"; anything else invalid goes too."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text.replace(" ", "-"))
    return value[:63].strip("-_.")


def gfd_labels(
    product: str,
    memory_bytes: int,
    count: int,
    mig: Sequence[tuple[str, int, int, int]] = (),
) -> dict[str, str]:
    """The labels NVIDIA GPU Feature Discovery writes for a node's GPUs.

    From NVIDIA/k8s-device-plugin (GFD lives there now): internal/lm/resource.go,
    NewGPUResourceLabeler: `nvidia.com/gpu.product` (the NVML name, spaces replaced by "-"),
    `nvidia.com/gpu.count`, `nvidia.com/gpu.replicas` (1 unless shared), and
    `nvidia.com/gpu.memory` = NVML total memory / (1024 * 1024), i.e. MiB
    (internal/resource/nvml-device.go, GetTotalMemoryMB); MIG under the "mixed" strategy
    (internal/lm/mig-strategy.go): `nvidia.com/mig.strategy=mixed` and per profile, for the
    resource `nvidia.com/mig-<profile>`: `.product` (`<product>-MIG-<profile>`), `.count`,
    `.replicas`, and the MIG device's attributes (internal/resource/nvml-mig-device.go):
    `.memory` (MemorySizeMB, MiB), `.slices.gi`, `.slices.ci`. Compute capability, family,
    driver/CUDA versions, multiprocessors and engines are not simulated, so not labelled.

    `mig`: (profile, slices on the node, bytes per slice, compute slices) per profile.
    """
    labels = {
        "nvidia.com/gpu.product": label_value(product),
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.memory": str(memory_bytes // MIB),
    }
    if mig:
        labels["nvidia.com/mig.strategy"] = "mixed"
    for profile, n, slice_bytes, gi in mig:
        key = f"nvidia.com/mig-{profile}"
        labels.update(
            {
                f"{key}.product": label_value(f"{product}-MIG-{profile}"),
                f"{key}.count": str(n),
                f"{key}.replicas": "1",
                f"{key}.memory": str(slice_bytes // MIB),
                f"{key}.slices.gi": str(gi),
                f"{key}.slices.ci": str(gi),
            }
        )
    return labels


# ------------------------------------------------------------------------------ the Node


def kubelet_conditions(now: str) -> list[dict[str, Any]]:
    """The conditions a healthy kubelet posts: Ready, and no pressure of any kind."""
    pressure = (
        ("MemoryPressure", "SufficientMemory"),
        ("DiskPressure", "NoDiskPressure"),
        ("PIDPressure", "SufficientPID"),
    )
    return [
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
            for t, r in pressure
        ],
    ]


def node_status(
    gpus: int, memory: str, cpu: str, address: str, resources: Mapping[str, str] | None = None
) -> dict[str, Any]:
    now = _now().isoformat()
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(gpus), **(resources or {})}
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": kubelet_conditions(now),
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
    labels: Mapping[str, str] | None = None,
    resources: Mapping[str, str] | None = None,
) -> None:
    """Create (or take over) the Node and mark it Ready, then renew its Lease. `labels` go on
    the Node (GPU Feature Discovery's, say); `resources` are extended resources beyond
    `nvidia.com/gpu` (MIG profiles), as capacity and allocatable."""
    core = client.CoreV1Api(api)
    node_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "nvidia.com/gpu.present": "true",
        **(labels or {}),
    }
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": node_labels}}
    try:
        core.create_node(body)
    except ApiException as e:
        if e.status != 409:
            raise
        core.patch_node(name, {"metadata": {"labels": node_labels}})  # taking over: today's labels
    core.patch_node_status(name, {"status": node_status(gpus, memory, cpu, address, resources)})
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
    # Post what a healthy kubelet posts, not what the node holds: after an API outage the node
    # controller has set every condition Unknown, and copying that back would keep it so.
    held = {c.type: c for c in node.status.conditions or []}
    conditions = kubelet_conditions(now.isoformat())
    for c in conditions:
        before = held.get(c["type"])
        if before is not None and before.status == c["status"] and before.last_transition_time:
            c["lastTransitionTime"] = api.sanitize_for_serialization(before.last_transition_time)
    core.patch_node_status(name, {"status": {"conditions": conditions}})


def node_schedulable(api: client.ApiClient, name: str) -> bool:
    """True once the lifecycle controller has lifted the not-ready taint."""
    node = client.CoreV1Api(api).read_node(name)
    taints = node.spec.taints or []
    return not any(t.key.startswith("node.kubernetes.io/not-ready") for t in taints)
