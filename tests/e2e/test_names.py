"""Any name the CRD admits works end to end; the CRD refuses the ones that cannot.

Drills on the first version found two kinds of names that broke things. A name over 63
characters was cut short in the pod label while the pod index was looked up by the full name,
so the operator was blind: Ready 1/1, no ranks, OOMs never remediated. A name that is a valid
LLMService name but not a valid Service name (`my.svc`, `1svc`) got a 422 on the Service
every pass, and no status was ever written.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import LLMSERVICE_LABEL, label_value, service_name

from .conftest import apply_service, condition, example, get_llmservice, wait_for

pytestmark = pytest.mark.e2e


def _named(doc: dict[str, Any], name: str) -> dict[str, Any]:
    doc["metadata"] = {"name": name}
    return doc


def test_a_long_dotted_name_is_remediated_to_ready_with_its_ranks(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("llama3-70b-tp4", time_scale=4)
    name = "llama3-70b-tp4." + "team-inference-platform-production-" * 3 + "east"
    assert len(name) > 63 and "." in name
    apply_service(api, e2e_namespace, _named(example(), name))

    def remediated_and_ready() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, name)
        st = svc.get("status") or {}
        ready = (condition(svc, "Ready") or {}).get("status") == "True"
        oom = any(r["trigger"] == "CUDAOutOfMemory" for r in st.get("remediations") or [])
        return svc if ready and oom and len(st.get("ranks") or []) == 4 else None

    wait_for(
        "the long-named service remediated and Ready with 4 ranks",
        remediated_and_ready,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, name).get("status"),
    )
    core = client.CoreV1Api(api)
    svc = core.read_namespaced_service(service_name(name), e2e_namespace)
    assert svc.spec.selector[LLMSERVICE_LABEL] == label_value(name) != name
    pods = core.list_namespaced_pod(e2e_namespace, label_selector=f"{LLMSERVICE_LABEL}={label_value(name)}")
    assert pods.items, "the pods carry the shortened label the selector uses"


@pytest.mark.parametrize("name", ["1svc", "my.svc"])
def test_a_name_that_is_no_service_name_still_gets_its_service_and_a_status(
    api: client.ApiClient, e2e_namespace: str, name: str
) -> None:
    apply_service(api, e2e_namespace, _named(example(), name))
    svc = wait_for(
        f"a status for {name}",
        lambda: (
            (s := get_llmservice(api, e2e_namespace, name)).get("status", {}).get("observedGeneration") and s
        ),
        120,
    )
    assert (condition(svc, "Degraded") or {}).get("reason") != "ApplyRefused"
    fronted = client.CoreV1Api(api).read_namespaced_service(service_name(name), e2e_namespace)
    assert fronted.metadata.name != name
    assert fronted.spec.selector[LLMSERVICE_LABEL] == label_value(name)


def test_a_name_too_long_for_the_deployments_replicasets_is_refused_at_apply(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    with pytest.raises(ApiException) as refused:
        apply_service(api, e2e_namespace, _named(example(), "a" * 243))
    assert refused.value.status == 422
    assert "longer than 242 characters" in str(refused.value.body)
    apply_service(api, e2e_namespace, _named(example(), "a" * 242))  # the longest that works
