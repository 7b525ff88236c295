"""Any name the CRD admits works end to end; the CRD refuses the ones that cannot, and rankguard
refuses a name another LLMService already derives (and another service's cache claim).

Drills on the first version found two kinds of names that broke things. A name over 63
characters was cut short in the pod label while the pod index was looked up by the full name,
so the operator was blind: Ready 1/1, no ranks, OOMs never remediated. A name that is a valid
LLMService name but not a valid Service name (`my.svc`, `1svc`) got a 422 on the Service
every pass, and no status was ever written.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import LLMSERVICE_LABEL, cache_claim_name, label_value, service_name

from .conftest import GROUP, PLURAL, VERSION, apply_service, condition, example, get_llmservice, wait_for

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


# --------------------------------------------------------------------------------------------
# Two LLMServices on one name (issue 30): a 70-character name is shortened to a 63-character
# label value and Service name that another LLMService can take as its literal name.


def _degraded_as(api: client.ApiClient, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    svc = get_llmservice(api, ns, name)
    d = condition(svc, "Degraded") or {}
    return svc if d.get("status") == "True" and d.get("reason") == reason else None


def _controller(obj: Any) -> str | None:
    refs = obj.metadata.owner_references or []
    return next((r.name for r in refs if r.controller), None)


def _read(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def test_a_name_another_service_derives_is_refused_until_the_older_one_goes(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("llama3-70b-tp4", time_scale=4)
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    long = "llama3-70b-tp4-team-inference-platform-production-east-" + "x" * 15
    short = label_value(long)
    assert len(long) == 70 and len(short) == 63 and service_name(long) == short
    created = apply_service(api, e2e_namespace, _named(example(), long))["metadata"]["creationTimestamp"]
    # the second is created in a later second than the first (creationTimestamp's resolution),
    # so "older" is not decided by the names' tie-break
    wait_for(
        "a second past the first's creation",
        lambda: (
            datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
            > datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
        ),
        5,
    )
    apply_service(api, e2e_namespace, _named(example(), short))

    refused = wait_for(
        f"{short} Degraded NameTaken",
        lambda: _degraded_as(api, e2e_namespace, short, "NameTaken"),
        120,
        dump=lambda: get_llmservice(api, e2e_namespace, short).get("status"),
    )
    message = condition(refused, "Degraded")["message"]  # type: ignore[index]
    assert f"LLMService {long}" in message and "another name" in message, message
    assert (condition(refused, "Ready") or {}).get("status") == "False"

    def serving() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, long)
        return svc if (condition(svc, "Ready") or {}).get("status") == "True" else None

    wait_for(
        f"{long} Ready", serving, 240, dump=lambda: get_llmservice(api, e2e_namespace, long).get("status")
    )
    # the younger one applied nothing, and the one Service is the older's
    assert _read(apps.read_namespaced_deployment, short, e2e_namespace) is None
    fronted = core.read_namespaced_service(short, e2e_namespace)
    assert _controller(fronted) == long
    assert fronted.spec.selector[LLMSERVICE_LABEL] == short
    assert _degraded_as(api, e2e_namespace, short, "NameTaken") is not None  # still, after passes

    client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, e2e_namespace, PLURAL, long)

    def taken_over() -> bool:
        svc = _read(core.read_namespaced_service, short, e2e_namespace)
        deployment = _read(apps.read_namespaced_deployment, short, e2e_namespace)
        degraded = condition(get_llmservice(api, e2e_namespace, short), "Degraded") or {}
        return (
            svc is not None
            and _controller(svc) == short
            and deployment is not None
            and degraded.get("reason") not in ("NameTaken", None)
        )

    wait_for(
        f"{short} proceeding with its own Service once {long} is gone",
        taken_over,
        120,
        dump=lambda: get_llmservice(api, e2e_namespace, short).get("status"),
    )


# --------------------------------------------------------------------------------------------
# A cache claim another LLMService owns (issue 30): deleted with that service, under this one.


def test_another_services_cache_claim_is_refused_and_model_cache_ready_follows_it_going(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    owner = _named(example(), "cache-owner")
    owner["spec"]["modelCache"] = {"size": "1Gi"}
    apply_service(api, e2e_namespace, owner)
    claim = cache_claim_name("cache-owner")
    wait_for(
        "the owner's claim",
        lambda: _read(core.read_namespaced_persistent_volume_claim, claim, e2e_namespace),
        60,
    )

    borrower = _named(example(), "borrower")
    borrower["spec"]["modelCache"] = {"claimName": claim}
    apply_service(api, e2e_namespace, borrower)
    svc = wait_for(
        "borrower Degraded ModelCacheClaimTaken",
        lambda: _degraded_as(api, e2e_namespace, "borrower", "ModelCacheClaimTaken"),
        120,
        dump=lambda: get_llmservice(api, e2e_namespace, "borrower").get("status"),
    )
    assert "LLMService cache-owner" in condition(svc, "Degraded")["message"]  # type: ignore[index]
    cache = condition(svc, "ModelCacheReady") or {}
    assert (cache.get("status"), cache.get("reason")) == ("False", "ClaimOwnedByAnotherService")
    assert _read(apps.read_namespaced_deployment, "borrower", e2e_namespace) is None

    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        GROUP, VERSION, e2e_namespace, PLURAL, "cache-owner"
    )

    def gone() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, "borrower")
        c = condition(svc, "ModelCacheReady") or {}
        return svc if (c.get("status"), c.get("reason")) == ("False", "ClaimNotFound") else None

    svc = wait_for(
        "borrower's ModelCacheReady False ClaimNotFound once the owner's claim is gone",
        gone,
        120,
        dump=lambda: get_llmservice(api, e2e_namespace, "borrower").get("status"),
    )
    assert (condition(svc, "Degraded") or {}).get("reason") != "ModelCacheClaimTaken"
    # no longer refused: its pods are rendered, and wait (Pending) for a claim of that name
    wait_for(
        "borrower's Deployment", lambda: _read(apps.read_namespaced_deployment, "borrower", e2e_namespace), 60
    )
