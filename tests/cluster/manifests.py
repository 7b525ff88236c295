"""Plain pods and Deployments pinned to one node, for the tests of the sandbox's node itself
(the process kubelet, the control plane's smoke test): the objects a person would apply."""

from __future__ import annotations

from typing import Any


def pod_manifest(node: str, name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": "Never",
            "containers": containers,
            **spec,
        },
    }


def deployment_manifest(node: str, name: str, containers: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica on `node`, its pods labelled app=<name>."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "containers": containers},
            },
        },
    }
