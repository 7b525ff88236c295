"""The pod index and the daemon agree on a service's key, whatever the LLMService's name; the
watch of LLMServices tells a running daemon that its service is gone."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import kopf
import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from rankguard_operator.edge.handlers import _gone, _wakers, service_key, serving_pods, spec_changed

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


async def test_a_deleted_event_marks_a_running_daemons_service_gone_and_wakes_it() -> None:
    """A service deleted at once (no deletion under way that kopf saw, so kopf stops no daemon)
    still ends its daemon's loop: the DELETED event marks its UID gone and wakes the daemon. A
    service whose daemon has already stopped (kopf's own path) is not remembered."""
    memo = kopf.Memo()
    wake = _wakers(memo).setdefault(service_key("ns", "llama"), {}).setdefault("llama", asyncio.Event())
    body = cast(kopf.Body, {"metadata": {"name": "llama", "uid": "u-1", "generation": 1}, "status": {}})
    await spec_changed(name="llama", namespace="ns", body=body, type="MODIFIED", memo=memo)
    assert _gone(memo) == set() and wake.is_set()  # a spec edit only wakes it
    wake.clear()
    await spec_changed(name="llama", namespace="ns", body=body, type="DELETED", memo=memo)
    assert _gone(memo) == {"u-1"} and wake.is_set()
    other = cast(kopf.Body, {"metadata": {"name": "other", "uid": "u-2"}})
    await spec_changed(name="other", namespace="ns", body=other, type="DELETED", memo=memo)
    assert _gone(memo) == {"u-1"}
