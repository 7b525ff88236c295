"""Fixtures of the in-process operator tests: a namespace the operator alone watches, the
environment `python -m rankguard_operator` would get, and the `World` over both
(operator_world.py)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from operator_world import GROUP, MERGE, PLURAL, SCRAPE_INTERVAL, VERSION, World

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.waiting import wait_for

# --------------------------------------------------------------------------------------------
# A namespace the in-process operator alone watches, its environment, and the World over them


@pytest.fixture
def op_namespace(api: client.ApiClient, crd: str) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"op-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name, "labels": {"rankguard.io/test": "true"}}})
    # The ReplicaSet controller cannot create pods before the default ServiceAccount exists.
    wait_for("the default ServiceAccount", lambda: _has_default_sa(core, name))
    try:
        yield name
    finally:
        # The operator is stopped by now, so nothing would ever remove kopf's finalizer (or the
        # test's own hold on a pod): drop them, or the namespace would never go away.
        custom = client.CustomObjectsApi(api)
        for item in custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL).get("items", []):
            with contextlib.suppress(ApiException):
                custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    name,
                    PLURAL,
                    item["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                    _content_type=MERGE,
                )
        for pod in core.list_namespaced_pod(name).items:
            if pod.metadata.finalizers:
                with contextlib.suppress(ApiException):
                    core.patch_namespaced_pod(
                        pod.metadata.name, name, {"metadata": {"finalizers": None}}, _content_type=MERGE
                    )
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)


def _has_default_sa(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account("default", namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        return False
    return True


@pytest.fixture
def operator_env(cluster: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `python -m rankguard_operator` gets from its environment, for an in-process run."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setenv("RANKGUARD_METRICS_PORT", "0")
    monkeypatch.setenv("RANKGUARD_SCRAPE_INTERVAL", str(SCRAPE_INTERVAL))
    # Idle services pass only on events or every resync; "the loop looked" (QUIET_PASSES) needs
    # passes while the pods here sit unscheduled (this test plays the kubelet), so as often.
    monkeypatch.setenv("RANKGUARD_RESYNC_INTERVAL", str(SCRAPE_INTERVAL))
    # The kubernetes client reads KUBECONFIG once, when it is imported (long before this test);
    # k8s.login() calls load_kube_config() without a path, so point the default at our cluster.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))


@pytest.fixture
def world(api: client.ApiClient, op_namespace: str, operator_env: None) -> World:
    return World(api, op_namespace)
