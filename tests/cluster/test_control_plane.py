"""Smoke tests: the control plane is real (controllers, scheduler, GC, RBAC all answer)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from manifests import deployment_manifest

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kubelet.nodes import heartbeat, node_schedulable, register_node
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster


def test_deployment_pod_is_scheduled_on_gpu_node_and_namespace_is_collected(
    api: client.ApiClient, namespace: str
) -> None:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    node = f"gpu-node-{uuid.uuid4().hex[:6]}"
    register_node(api, node, gpus=8)

    def schedulable() -> bool:
        heartbeat(api, node)  # as a kubelet would, so the lifecycle controller lifts the taint
        return node_schedulable(api, node)

    wait_for("the node to lose its not-ready taint", schedulable, timeout=90, every=1)
    assert core.read_node(node).status.capacity["nvidia.com/gpu"] == "8"

    gpu_container = {
        "name": "main",
        "image": "example.invalid/vllm:1",
        "resources": {"limits": {"nvidia.com/gpu": "2"}},
    }
    apps.create_namespaced_deployment(namespace, deployment_manifest(node, "smoke", [gpu_container]))
    rs = wait_for(
        "the controller-manager to create a ReplicaSet",
        lambda: apps.list_namespaced_replica_set(namespace).items,
    )
    assert rs[0].metadata.owner_references[0].kind == "Deployment"
    pods = wait_for("a Pod from the ReplicaSet", lambda: core.list_namespaced_pod(namespace).items)
    assert pods[0].metadata.owner_references[0].kind == "ReplicaSet"
    bound = wait_for(
        "the scheduler to bind the Pod to the GPU node",
        lambda: [p for p in core.list_namespaced_pod(namespace).items if p.spec.node_name == node],
    )
    assert bound[0].spec.node_name == node

    # Deleting the namespace cascades. With no kubelet, the test finishes pod deletion itself,
    # exactly as a kubelet confirms a terminated pod (delete with grace period 0).
    core.delete_namespace(namespace)

    def namespace_gone() -> bool:
        for p in core.list_namespaced_pod(namespace).items:
            if p.metadata.deletion_timestamp:
                try:
                    core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
                except ApiException as e:
                    if e.status != 404:
                        raise
        try:
            core.read_namespace(namespace)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    wait_for(
        "the namespace and everything in it to be garbage-collected", namespace_gone, timeout=90, every=0.5
    )
    assert (
        apps.list_replica_set_for_all_namespaces(field_selector=f"metadata.namespace={namespace}").items == []
    )
    core.delete_node(node)


def test_service_account_token_is_refused_what_its_role_does_not_grant(
    cluster: ControlPlane, api: client.ApiClient, namespace: str, tmp_path: Any
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    # TokenRequest needs no kubelet: the apiserver signs the token itself.
    tr = core.create_namespaced_service_account_token(
        "reader", namespace, {"spec": {"expirationSeconds": 600}}
    )
    kubeconfig = cluster.token_kubeconfig(tr.status.token, tmp_path / "reader.kubeconfig")
    from kubernetes import config

    sa_api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        sa_core = client.CoreV1Api(sa_api)
        assert sa_core.list_namespaced_pod(namespace).items == []  # granted
        with pytest.raises(ApiException) as denied:
            sa_core.list_namespaced_secret(namespace)  # not granted
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied_other_ns:
            sa_core.list_namespaced_pod("default")  # a Role grants nothing outside its namespace
        assert denied_other_ns.value.status == 403
    finally:
        sa_api.close()

    can_i = cluster.kubectl(
        "auth",
        "can-i",
        "delete",
        "pods",
        "-n",
        namespace,
        f"--as=system:serviceaccount:{namespace}:reader",
        check=False,
    )
    assert can_i.stdout.strip() == "no"
