"""End to end: an operator given a namespace glob (RANKGUARD_WATCH_NAMESPACES=e2e-*, the e2e
operator's own setting) serves the namespaces it matches, created after it started, and leaves
every other namespace alone. The glob is matched by the handlers' filter on a cluster-wide watch
(edge/config.py says why not by kopf's namespace scanning).
"""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from rankguard_sim.world import create_namespace

from .conftest import apply_service, get_llmservice
from .test_failing_loudly import service, wait_degraded

pytestmark = pytest.mark.e2e


def test_a_glob_serves_the_namespaces_it_matches_and_no_other(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    outside = f"outside-{uuid.uuid4().hex[:8]}"
    create_namespace(api, outside)
    try:
        # the same spec each side: one the operator judges invalid in its first pass
        doc = service("flag", engine={"extraArgs": ["--enable-frobnication"]})
        apply_service(api, outside, doc)  # first, so a cluster-wide watch delivers it first
        apply_service(api, e2e_namespace, doc)
        wait_degraded(api, e2e_namespace, "flag", "InvalidSpec", 120)
        assert "status" not in get_llmservice(api, outside, "flag")
    finally:
        client.CoreV1Api(api).delete_namespace(outside)  # and the service in it (no pods there)
