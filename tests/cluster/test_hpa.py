"""The real HPA controller scales an LLMService end to end (issue 52).

The sandbox's kube-controller-manager runs the HPA controller; an External metric reaches it the
way prometheus-adapter serves one, through an APIService (rankguard_sim.kube.external_metrics,
whose values this test sets as the adapter would serve the recording rule
`rankguard:llmservice_demand_replicas`). The HPA moves `spec.replicas` through the LLMService's
scale subresource; the in-process operator (operator_world.py) adds the replica, this test plays
its kubelet and agent, and the operator's status and capacity metric follow.

Every wait dumps the HPA's and the service's status on timeout, so a failure names the link that
broke: the scale subresource (AbleToScale False, FailedGetScale), its selector (ScalingActive
False, InvalidSelector: no `status.selector`), the metric (ScalingActive False,
FailedGetExternalMetric), or the operator.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from operator_world import (
    GROUP,
    MODEL,
    PLURAL,
    VERSION,
    GiB,
    ReportServer,
    World,
    operator,
    service_doc,
)
from prometheus_client import REGISTRY

from rankguard_agent.wire.recognisers import KV_TOKENS
from rankguard_agent.wire.report import KVLine, RankSample, Report
from rankguard_sim.kube.cluster import ControlPlane, free_port
from rankguard_sim.kube.external_metrics import ExternalMetricsApi
from rankguard_sim.vllm_snapshot import message
from rankguard_sim.waiting import wait_for
from tests.cluster.example_files import documents

pytestmark = pytest.mark.cluster

DEMAND = "rankguard:llmservice_demand_replicas"
HPA_EXAMPLE = Path(__file__).parents[2] / "examples" / "autoscaling" / "hpa-external-metric.yaml"
MAX_MODEL_LEN = 8192  # service_doc's engine.maxModelLen
ENGINE_TOKENS = 1_050_000  # what "the engine" logs as its KV cache size (the plan says 1,058,048)
# The controller-manager's HPA looks every 2s (cluster.py), the operator every 0.5s; a loaded
# 2-core CI box may still take long over each link.
LINK_TIMEOUT = 120


@pytest.fixture
def metrics_api(cluster: ControlPlane) -> Iterator[ExternalMetricsApi]:
    with ExternalMetricsApi.start(cluster) as api:
        yield api


def engine_report(tokens: int) -> bytes:
    """An agent's report with the engine's "KV cache size" line, rendered from the recorded
    vLLM format (the operator reads its value; the text is what the agent saw)."""
    now = time.time()
    ranks = [
        RankSample(
            rank=r,
            uuid=f"GPU-{r:08d}-test",
            total_bytes=80 * GiB,
            used_bytes=76 * GiB,
            free_bytes=4 * GiB,
            min_free_bytes=3 * GiB,
            window_seconds=10.0,
        )
        for r in range(2)  # service_doc's tensorParallelSize
    ]
    text = message("kv_cache_size", "GPU", f"{tokens:,}", f"{MAX_MODEL_LEN:,}", tokens / MAX_MODEL_LEN)
    line = KVLine(kind=KV_TOKENS, text=text, value=float(tokens), timestamp=now)
    return Report(version=1, agent_version="0.1.0", timestamp=now, ranks=ranks, kv_lines=[line]).to_json()


def hpa_doc(target: str) -> dict[str, Any]:
    """The HPA a platform engineer applies (examples/autoscaling/hpa-external-metric.yaml: an
    autoscaling/v2 HPA on the LLMService itself, External metric, AverageValue 800m, so desired
    replicas = ceil(demand / 0.8)), pointed at `target`."""
    [doc] = [d for d in documents(HPA_EXAMPLE) if d["kind"] == "HorizontalPodAutoscaler"]
    doc["metadata"]["name"] = target
    doc["spec"]["scaleTargetRef"]["name"] = target
    [metric] = doc["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == DEMAND, metric
    metric["external"]["metric"]["selector"] = {"matchLabels": {"llmservice": target}}
    return doc


def capacity_metric(ns: str, name: str) -> float | None:
    return REGISTRY.get_sample_value(
        "rankguard_llmservice_kv_capacity_tokens", {"namespace": ns, "llmservice": name, "model_name": MODEL}
    )


def test_the_hpa_controller_scales_an_llmservice_on_an_external_metric(
    world: World, metrics_api: ExternalMetricsApi
) -> None:
    ns, port = world.ns, free_port()
    hpas = client.AutoscalingV2Api(world.api)

    def hpa() -> dict[str, Any]:
        return world.as_dict(hpas.read_namespaced_horizontal_pod_autoscaler("svc", ns))

    def hpa_condition(type_: str) -> dict[str, Any]:
        return next((c for c in hpa().get("status", {}).get("conditions") or [] if c["type"] == type_), {})

    def hpa_condition_true(type_: str) -> bool:
        return hpa_condition(type_).get("status") == "True"

    def dump() -> dict[str, Any]:
        try:
            h: Any = hpa().get("status")
        except client.ApiException as e:
            h = f"no HPA: {e.status}"
        return {
            "hpa": h,
            "llmservice": world.status("svc"),
            "asked": metrics_api.values.asked_for(ns, DEMAND),
        }

    with ReportServer(port) as agent, operator(ns):
        agent.serve(lambda: engine_report(ENGINE_TOKENS))
        world.create(service_doc("svc", port, replicas=1))
        world.ready_service("svc")
        first = world.new_pod("svc")["metadata"]["name"]
        world.kubelet_ready(first)
        # One replica, its engine's figure in status: what the scale subresource reads is there.
        status = wait_for(
            "status.replicas 1, the selector, and the engine's capacity",
            lambda: (
                (s := world.status("svc")).get("replicas") == 1
                and s.get("selector")
                and (s.get("capacity") or {}).get("source") == "engine"
                and s
            ),
            timeout=LINK_TIMEOUT,
            dump=dump,
        )
        assert status["capacity"]["tokens"] == ENGINE_TOKENS, status["capacity"]
        assert capacity_metric(ns, "svc") == ENGINE_TOKENS

        # The demand: 1.5 replicas' worth of KV in use and queued; 0.8 per replica, so ceil(1.875) = 2.
        metrics_api.values.set_value(ns, DEMAND, 1.5, {"namespace": ns, "llmservice": "svc"})
        metrics_api.values.set_value(ns, DEMAND, 9.0, {"namespace": ns, "llmservice": "another"})  # not ours
        hpas.create_namespaced_horizontal_pod_autoscaler(ns, hpa_doc("svc"))

        # Each link, in order: the HPA read the scale subresource, then the metric, then scaled.
        for condition in ("AbleToScale", "ScalingActive"):
            wait_for(
                f"the HPA's {condition} condition True",
                partial(hpa_condition_true, condition),
                timeout=LINK_TIMEOUT,
                dump=dump,
            )
        asked = metrics_api.values.asked_for(ns, DEMAND)
        assert asked and {a.label_selector for a in asked} == {"llmservice=svc"}, asked
        wait_for(
            "the HPA to set spec.replicas 2",
            lambda: world.svc("svc")["spec"]["replicas"] == 2,
            timeout=LINK_TIMEOUT,
            dump=dump,
        )

        # The operator adds the replica; the kubelet (this test) runs it and its agent reports.
        wait_for(
            "the Deployment at 2 replicas",
            lambda: ((world.deployment("svc") or {}).get("spec") or {}).get("replicas") == 2,
            timeout=LINK_TIMEOUT,
            dump=dump,
        )
        second = world.new_pod("svc", not_in=(first,))["metadata"]["name"]
        world.kubelet_ready(second)
        status = wait_for(
            "status.replicas 2 and both ready",
            lambda: (s := world.status("svc")).get("replicas") == 2 and s.get("readyReplicas") == 2 and s,
            timeout=LINK_TIMEOUT,
            dump=dump,
        )
        wait_for(
            "the HPA to see 2 current replicas",
            lambda: hpa().get("status", {}).get("currentReplicas") == 2,
            timeout=LINK_TIMEOUT,
            dump=dump,
        )
        assert hpa()["status"]["desiredReplicas"] == 2, dump()

        # A scale is not a spec edit that rolls pods: the first replica is still the first pod.
        live = {
            p["metadata"]["name"] for p in world.pods("svc") if not p["metadata"].get("deletionTimestamp")
        }
        assert live == {first, second}, live
        # What the HPA read, as it read it: the scale subresource, whose selector finds the pods.
        scale = world.custom.get_namespaced_custom_object_scale(GROUP, VERSION, ns, PLURAL, "svc")
        assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (2, 2), scale
        selected = world.core.list_namespaced_pod(ns, label_selector=scale["status"]["selector"]).items
        assert {p.metadata.name for p in selected} == live, scale
        # The capacity per replica is what it was; the metric follows the status.
        assert status["capacity"]["tokens"] == ENGINE_TOKENS, status["capacity"]
        assert capacity_metric(ns, "svc") == ENGINE_TOKENS
