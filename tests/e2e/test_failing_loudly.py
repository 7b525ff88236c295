"""End to end: fail loudly, and once. What no engine can run is refused at `kubectl apply` or
before anything is deployed; an engine that keeps failing, a replica no node can hold and a floor
above the node's GPU each show a condition with a reason a person understands, what to change,
and one Event (issue 13, point 5; the pure step's cases are in
tests/unit/core/step/test_reconcile_fail_loudly.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.units import parse_iso
from tests.builders import llmservice

from .conftest import (
    apply_service,
    condition,
    degraded_as,
    deployments,
    events,
    get_llmservice,
    wait_degraded,
    wait_for,
)

pytestmark = pytest.mark.e2e

SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 2,
    "engine": {"maxModelLen": 8192},
}


def service(name: str, **spec: Any) -> dict[str, Any]:
    return llmservice(name, {**SPEC, **spec})


def test_what_no_engine_can_run_is_refused_before_anything_is_deployed(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    ns = e2e_namespace
    # the API server refuses what the CRD can judge alone, each with its own message
    refused = [
        (service("cfg", engine={"extraArgs": ["--config", "serve.yaml"]}), "rankguard manages"),
        (service("one-byte", memory={"kvCacheMemoryBytes": 1}), "must be at least 1048576 (1 MiB)"),
        (
            service(
                "floor", memory={"gpuMemoryBytes": 80 * 2**30}, remediation={"minKVCacheBytes": 15 * 2**39}
            ),
            "must be smaller than memory.gpuMemoryBytes",
        ),
    ]
    for doc, message in refused:
        with pytest.raises(ApiException) as e:
            apply_service(api, ns, doc)
        assert e.value.status == 422 and message in str(e.value.body), e.value.body
    # the operator refuses what needs vLLM's CLI or the model's shape: an unknown flag, and a pinned
    # budget below one request of maxModelLen
    apply_service(api, ns, service("flag", engine={"extraArgs": ["--enable-frobnication"]}))
    apply_service(api, ns, service("small", memory={"kvCacheMemoryBytes": 64 * 2**20}))
    for name, said in (("flag", "has no option --enable-frobnication"), ("small", "cannot hold one request")):
        svc = wait_degraded(api, ns, name, "InvalidSpec", 60)
        assert svc["status"]["phase"] == "Failed"
        assert said in condition(svc, "Degraded")["message"]  # type: ignore[index]
        assert len(events(api, ns, name, "InvalidSpec")) == 1
    assert deployments(api, ns) == []


def test_an_engine_that_keeps_failing_is_degraded_once_with_its_own_words(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    node = make_node("llama3-8b-tp2-24gb", time_scale=4)
    error = "the checkpoint's tokenizer.json is corrupt"
    node.kubelet.inject_start_faults("vllm", 100, error)  # every start of vLLM fails, not for memory
    # the card's size given, so rankguard plans from the start (no replan roll to wait for)
    apply_service(api, e2e_namespace, service("loop", memory={"gpuMemoryBytes": round(23.58 * 2**30)}))
    core = client.CoreV1Api(api)

    def restarts() -> int:
        pods = core.list_namespaced_pod(e2e_namespace, label_selector="app.kubernetes.io/instance=loop").items
        counts = [cs.restart_count for p in pods for cs in (p.status.container_statuses or [])]
        return max(counts, default=0)

    svc = wait_for(
        "Degraded EngineCrashLoop after several restarts",
        lambda: restarts() >= 2 and degraded_as(api, e2e_namespace, "loop", "EngineCrashLoop"),
        180,
        dump=lambda: get_llmservice(api, e2e_namespace, "loop").get("status"),
    )
    message = condition(svc, "Degraded")["message"]  # type: ignore[index]
    assert error in message and "spec.engine.extraArgs" in message
    assert svc["status"]["phase"] == "Degraded"
    [before] = deployments(api, e2e_namespace)
    wait_for("two more runs to fail", lambda: restarts() >= 4, 120)
    # said once however many runs fail, and nothing rolled: no flag change can fix this
    assert len(events(api, e2e_namespace, "loop", "EngineCrashLoop")) == 1
    [after] = deployments(api, e2e_namespace)
    assert after.metadata.generation == before.metadata.generation
    assert degraded_as(api, e2e_namespace, "loop", "EngineCrashLoop")


def test_a_replica_no_node_can_hold_is_degraded_with_the_schedulers_words(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    doc = service("huge", tensorParallelSize=64, model={"name": "meta-llama/Meta-Llama-3-70B-Instruct"})
    apply_service(api, e2e_namespace, doc)
    svc = wait_degraded(api, e2e_namespace, "huge", "Unschedulable", 120)
    message = condition(svc, "Degraded")["message"]  # type: ignore[index]
    assert "the scheduler cannot place pod huge-" in message and "64 nvidia.com/gpu" in message, message
    assert "nodes are available" in message or "no nodes available" in message, message
    assert svc["status"]["phase"] == "Degraded"
    assert parse_iso(svc["status"]["unschedulableSince"]) is not None
    assert len(events(api, e2e_namespace, "huge", "Unschedulable")) == 1


def test_a_floor_above_the_gpu_the_node_states_is_refused(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    """No gpuMemoryBytes, so the CRD cannot compare; once the pod lands on a node, its GPU
    Feature Discovery labels give the size, and the operator refuses the spec."""
    make_node("llama3-8b-tp2-24gb", time_scale=4)
    apply_service(api, e2e_namespace, service("floor", remediation={"minKVCacheBytes": 15 * 2**36}))
    svc = wait_degraded(api, e2e_namespace, "floor", "InvalidSpec", 120)
    message = condition(svc, "Degraded")["message"]  # type: ignore[index]
    assert "spec.remediation.minKVCacheBytes (960Gi" in message and "GPU Feature Discovery labels" in message
    assert svc["status"]["phase"] == "Failed"
    assert len(events(api, e2e_namespace, "floor", "InvalidSpec")) == 1
