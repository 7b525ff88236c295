"""The pod index and the daemon agree on a service's key, whatever the LLMService's name; the
watch of LLMServices tells a running daemon that its service is gone; what the watches keep in
memory is what the loop reads, and no more."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, cast

import kopf
import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.pods import deployment_template_hash, rollout_state
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step.scale_down import at_zero
from rankguard_operator.core.step.world import same_template
from rankguard_operator.core.units import GiB
from rankguard_operator.edge.handlers import (
    _gone,
    _wakers,
    llmservice_names,
    replicaset_owners,
    service_key,
    serving_deployments,
    serving_pods,
    serving_statefulsets,
    spec_changed,
)
from rankguard_operator.edge.packed import POD_SPEC_JSON, unpacked_deployment
from tests.builders import owner_ref

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


async def test_the_deployment_index_packs_the_pod_spec_and_a_pass_gets_the_deployment_back_whole() -> None:
    """The index keeps the pod template's spec as one JSON string (two thirds of a Deployment in
    memory as objects); a pass gets the Deployment back as watched, less its managedFields: it
    reads as the render, its rollout as the controller reports it, and a Failed service's scale
    to zero (which applies the live object back) carries the whole template. Before: the index
    left the pod spec out, and that apply was refused (422: containers required)."""
    rendered = render_deployment(
        "llama", "ns", "uid", SPEC, ServingFlags(kv_cache_memory_bytes=10 * GiB), agent_image="a:1", plan=None
    )
    live = {
        **rendered,
        "metadata": {**rendered["metadata"], "uid": "d-1", "generation": 3, "managedFields": [{}]},
        "status": {"observedGeneration": 3, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1},
    }
    watched = copy.deepcopy(live)  # kopf's own object, which the index handler lets go of some of
    indexed = await serving_deployments(namespace="ns", name="llama", body=cast(kopf.Body, watched))
    (kept,) = indexed.values()
    assert list(indexed) == [("ns", "llama")]
    assert "spec" not in kept["spec"]["template"] and isinstance(kept[POD_SPEC_JSON], str)
    whole = unpacked_deployment(kept)
    metadata = {k: v for k, v in live["metadata"].items() if k != "managedFields"}
    assert whole == {**live, "metadata": metadata}
    assert "spec" not in kept["spec"]["template"]  # unpacking left the kept entry as it was
    assert same_template(whole, rendered, SPEC.replicas)
    assert rollout_state(whole, deployment_template_hash(rendered) or "").phase != "unknown"
    assert at_zero(whole, "Deployment")["spec"]["template"] == rendered["spec"]["template"]
    assert "spec" not in watched["spec"]["template"]  # the copied part went from what kopf holds


def _watched(kind: str) -> dict[str, Any]:
    """A watched object of `kind` as the API server sends it, managedFields and all."""
    rendered = render_deployment(
        "llama", "ns", "uid", SPEC, ServingFlags(kv_cache_memory_bytes=10 * GiB), agent_image="a:1", plan=None
    )
    template = rendered["spec"]["template"]
    managed = {"managedFields": [{"manager": "kube-controller-manager", "fieldsV1": {"f:status": {}}}]}
    owner = [owner_ref("Deployment", "d-1", name="llama")]
    meta = {**template["metadata"], "name": "llama-x", "namespace": "ns", "uid": "u", **managed}
    owned = {**meta, "ownerReferences": owner}
    bodies: dict[str, dict[str, Any]] = {
        "Pod": {"metadata": owned, "spec": template["spec"], "status": {"phase": "Running"}},
        "Deployment": {**rendered, "metadata": {**rendered["metadata"], **managed}, "status": {}},
        "ReplicaSet": {"metadata": owned, "spec": {"replicas": 1, "template": template}},
        "LLMService": {"metadata": {**meta, "creationTimestamp": "t"}, "spec": {"model": {}}, "status": {}},
    }
    bodies["StatefulSet"] = bodies["Deployment"]
    return copy.deepcopy(bodies[kind])


async def _index(kind: str, body: dict[str, Any]) -> dict[Any, Any]:
    # the view kopf hands a handler over the object it keeps (processing: a Body over the raw event)
    meta, labels, b = body["metadata"], body["metadata"].get("labels", {}), kopf.Body(body)
    if kind == "Pod":
        return await serving_pods(namespace="ns", labels=labels, body=b)
    if kind == "Deployment":
        return await serving_deployments(namespace="ns", name=meta["name"], body=b)
    if kind == "StatefulSet":
        return await serving_statefulsets(namespace="ns", labels=labels, body=b)
    if kind == "ReplicaSet":
        return await replicaset_owners(namespace="ns", meta=meta, body=b)
    return await llmservice_names(name="llama", namespace="ns", meta=meta, spec=body["spec"], body=b)


@pytest.mark.parametrize("kind", ["Pod", "Deployment", "StatefulSet", "ReplicaSet", "LLMService"])
async def test_each_index_keeps_its_entry_and_the_watched_object_lets_go_what_it_copied(kind: str) -> None:
    """At start-up kopf holds every listed object after its index handler until all kinds are
    indexed; a thousand services' objects alive at once left an operator restarted at N=1,000 at
    ~395 MiB (issue 31). Each index handler drops from the object kopf holds its managedFields
    and the pod spec it has copied; its entry is the one an untouched copy gives; the rest stays
    (the wake handlers read labels and namespace, the daemon an LLMService's spec and status)."""
    watched = _watched(kind)
    entry = await _index(kind, watched)
    assert entry and entry == await _index(kind, _watched(kind))
    expected = _watched(kind)
    del expected["metadata"]["managedFields"]
    # besides managedFields, the pod spec the entry copied: a StatefulSet's entry shares its
    # spec, an LLMService's daemon reads its spec
    if kind == "Pod":
        expected["spec"] = {}  # emptied in place: it is the dict kopf's body holds
    if kind in ("Deployment", "ReplicaSet"):
        del expected["spec"]["template"]["spec"]
    assert watched == expected
