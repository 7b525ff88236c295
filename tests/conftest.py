"""Shared fixtures: one real control plane per test session, a fresh namespace per test.

Cluster tests are marked `cluster` (or `e2e`); the control plane starts only when such a
test runs, so `pytest tests/unit` never needs the binaries.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.world import create_namespace, install_crd


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane.start(tmp_path_factory.mktemp("control-plane"))
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def api(cluster: ControlPlane) -> Iterator[client.ApiClient]:
    c = cluster.api_client()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def crd(cluster: ControlPlane) -> str:
    """Install the LLMService CRD from crds/ and wait until API discovery serves it. The same
    install as the e2e tier's and the demo's (one field manager), whichever tier runs first."""
    install_crd(cluster)
    return "llmservices.rankguard.io"


@pytest.fixture
def namespace(api: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, with its default ServiceAccount ready; deleted after."""
    base = request.node.name.lower().replace("_", "-")
    name = (
        f"t-{''.join(ch for ch in base if ch.isalnum() or ch == '-')[:40].strip('-')}-{uuid.uuid4().hex[:5]}"
    )
    core = client.CoreV1Api(api)
    create_namespace(api, name, {"rankguard.io/test": "true"})
    try:
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except ApiException as e:
            if e.status != 404:
                raise
