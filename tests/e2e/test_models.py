"""End to end: models rankguard's catalog does not know. A private fine-tune is planned from the
config.json and safetensors headers the agent reads in the pod; a ConfigMap gives the shape
before any pod runs; an architecture the planner does not model is measured first, and says so."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from rankguard_operator.core.model.catalog import CATALOG_ENTRIES
from tests.builders import llmservice

from .conftest import apply_service, condition, get_llmservice, wait_for

pytestmark = pytest.mark.e2e

MODEL = "acme-corp/support-70b"  # the scenario's private fine-tune of Llama-3-70B
IMAGE = "vllm/vllm-openai:v0.33.0"


def _service(name: str, model: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return llmservice(
        name,
        {
            "model": model,
            "image": IMAGE,
            "tensorParallelSize": 4,
            "engine": {"maxModelLen": 8192},
            "remediation": {"cooldownSeconds": 30},
            **spec,
        },
    )


def _config_map(api: client.ApiClient, ns: str, name: str, config: dict[str, Any]) -> None:
    body = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name), data={"config.json": json.dumps(config)}
    )
    client.CoreV1Api(api).create_namespaced_config_map(ns, body)


def _events(api: client.ApiClient, ns: str, name: str) -> list[tuple[str, str]]:
    items = (
        client.CoreV1Api(api)
        .list_namespaced_event(
            ns, field_selector=f"involvedObject.name={name},involvedObject.kind=LLMService"
        )
        .items
    )
    return [(e.reason or "", e.message or "") for e in items]


def _budget_flags(svc: dict[str, Any]) -> bool:
    return "kvCacheMemoryBytes" in ((svc.get("status") or {}).get("servingFlags") or {})


def _llama3_70b_config() -> dict[str, Any]:
    return dict(CATALOG_ENTRIES["llama-3-70b"]["config"])


def test_a_model_no_catalog_knows_is_planned_from_what_the_agent_reads(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("support-70b-tp4", time_scale=4)
    apply_service(api, e2e_namespace, _service("private", {"name": MODEL}))

    def learned() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, "private")
        model = (svc.get("status") or {}).get("model") or {}
        resolved = condition(svc, "ModelResolved")
        if (
            model.get("source") == "agent"
            and resolved
            and resolved["status"] == "True"
            and _budget_flags(svc)
        ):
            return svc
        return None

    svc = wait_for(
        "the agent-read config.json to plan the service",
        learned,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "private").get("status"),
    )
    model = svc["status"]["model"]
    assert model["architecture"] == "LlamaForCausalLM" and model["attention"] == "gqa"
    assert model["weightsFrom"] == "checkpoint"  # the safetensors headers, not arithmetic
    assert json.loads(model["config"])["num_hidden_layers"] == 80
    reasons = [r for r, _ in _events(api, e2e_namespace, "private")]
    # measured first while nothing knew the model, then planned once the agent had read it
    assert "ModelMeasureFirst" in reasons and "ModelResolved" in reasons
    first = next(m for r, m in _events(api, e2e_namespace, "private") if r == "ModelMeasureFirst")
    assert "not in rankguard's catalog" in first


def test_a_config_map_plans_before_any_pod_runs_and_a_missing_one_is_named(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("support-70b-tp4", time_scale=4)
    doc = _service(
        "from-cm",
        {"name": MODEL, "configMap": {"name": "support-70b-config"}},
        memory={"gpuMemoryBytes": round(79.14 * 2**30)},
    )
    apply_service(api, e2e_namespace, doc)

    def says_missing() -> dict[str, Any] | None:
        c = condition(get_llmservice(api, e2e_namespace, "from-cm"), "ModelResolved")
        return c if c and c["status"] == "False" and "does not exist" in c["message"] else None

    missing = wait_for("the missing ConfigMap to be named", says_missing, 120)
    assert "support-70b-config" in missing["message"]

    _config_map(api, e2e_namespace, "support-70b-config", _llama3_70b_config())

    def planned() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, "from-cm")
        c = condition(svc, "ModelResolved")
        source = ((svc.get("status") or {}).get("model") or {}).get("source")
        return svc if c and c["status"] == "True" and source == "configMap" and _budget_flags(svc) else None

    wait_for(
        "the ConfigMap's config.json to plan the service",
        planned,
        180,
        dump=lambda: get_llmservice(api, e2e_namespace, "from-cm").get("status"),
    )
    dep = client.AppsV1Api(api).read_namespaced_deployment("from-cm", e2e_namespace)
    argv = dep.spec.template.spec.containers[0].command
    assert "--kv-cache-memory-bytes" in argv  # a planned byte budget, no measuring first


def test_an_architecture_the_planner_does_not_model_is_measured_first(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("support-70b-tp4", time_scale=4)
    unmodelled = {
        **_llama3_70b_config(),
        "model_type": "acme_hybrid",
        "architectures": ["AcmeHybridForCausalLM"],
    }
    _config_map(api, e2e_namespace, "hybrid-config", unmodelled)
    apply_service(
        api, e2e_namespace, _service("hybrid", {"name": MODEL, "configMap": {"name": "hybrid-config"}})
    )

    def measured() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, "hybrid")
        c = condition(svc, "ModelResolved")
        if c and c["status"] == "False" and c["reason"] == "MeasureFirst" and _budget_flags(svc):
            return svc
        return None

    svc = wait_for(
        "a byte budget from vLLM's own profile",
        measured,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "hybrid").get("status"),
    )
    c = condition(svc, "ModelResolved")
    assert c is not None and "AcmeHybridForCausalLM" in c["message"] and "measure-first" in c["message"]
    assert svc["status"]["model"]["modelled"] is False
    # the budget stands on what vLLM itself measured on every rank, not on priors
    assert len(svc["status"]["engine"]["ranks"]) == 4
    messages = [m for r, m in _events(api, e2e_namespace, "hybrid") if r == "ModelMeasureFirst"]
    assert len(messages) == 1  # one Event for the change, not one per pass
