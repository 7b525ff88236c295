"""The pod index and the daemon agree on a service's key, whatever the LLMService's name."""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from rankguard_operator.edge.handlers import service_key, serving_pods

SPEC = parse_spec(
    {
        "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "image": "vllm/vllm-openai:v0.33.0",
        "memory": {"gpuMemoryBytes": 80 * GiB},
    }
)


@pytest.mark.parametrize("name", ["llama", "a" * 63, "b" * 64, "long-" + "c" * 240])
async def test_a_pod_rendered_for_a_service_is_indexed_under_the_key_the_daemon_reads(name: str) -> None:
    """Before: the pod label was shortened past 63 characters while the daemon looked its pods
    up by the full name, so such a service never saw its pods (no ranks, no remediation)."""
    deployment = render_deployment(
        name,
        "ns",
        "uid",
        SPEC,
        ServingFlags(kv_cache_memory_bytes=10 * GiB),
        agent_image="a:1",
        plan=prior_plan(SPEC),
    )
    template = deployment["spec"]["template"]
    body: dict[str, Any] = {"metadata": {"name": "p-0", "uid": "u", **template["metadata"]}, "status": {}}
    indexed = await serving_pods(namespace="ns", labels=template["metadata"]["labels"], body=body)
    assert list(indexed) == [service_key("ns", name)]
    assert all(len(v) <= 63 for v in template["metadata"]["labels"].values())
