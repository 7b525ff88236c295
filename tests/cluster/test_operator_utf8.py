"""A character outside Unicode's Basic Multilingual Plane (an emoji in a model name) on a real
API server (issue 30): the kubernetes client's own body escapes it as a surrogate pair, which
the API server's YAML decoder refuses for every server-side apply; the operator sends its
applies as UTF-8 (edge/k8s.utf8_body), so the service is rendered, its status written and its
Events posted with the character intact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes.client.rest import ApiException
from operator_world import GiB, ReportServer, World, operator, service_doc, valid_report, vllm_container

from rankguard_operator.edge import k8s
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

MODEL = "acme/llama-\U0001f999-8b"  # 🦙, U+1F999: outside the BMP
SHAPE = {
    "vocabSize": 128256,
    "hiddenSize": 4096,
    "numLayers": 32,
    "numHeads": 32,
    "numKVHeads": 8,
    "intermediateSize": 14336,
}


def _deployment(name: str, ns: str, arg: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "busybox", "args": [arg]}]},
            },
        },
    }


def test_the_clients_own_apply_body_is_refused_and_the_operators_is_not(world: World) -> None:
    """The failure the operator avoids, shown on this API server, and the way around it."""
    doc = _deployment("plain-client", world.ns, MODEL)
    with pytest.raises(ApiException) as refused:
        world.apps.patch_namespaced_deployment(
            "plain-client", world.ns, doc, field_manager="test", force=True, _content_type=k8s._APPLY
        )
    assert refused.value.status in (400, 422, 500), refused.value
    stored = asyncio.run(k8s.apply(_deployment("utf8", world.ns, MODEL)))
    assert stored["spec"]["template"]["spec"]["containers"][0]["args"] == [MODEL]


def test_a_model_name_with_an_emoji_is_rendered_with_status_and_events(world: World) -> None:
    port = free_port()
    doc = service_doc("llama", port, model={"name": MODEL, "shape": SHAPE})
    with ReportServer(port) as agent, operator(world.ns):
        agent.serve(lambda: valid_report((3 * GiB, 3 * GiB)))
        world.create(doc)
        world.ready_service("llama")  # the Deployment applied: before the fix, every apply failed
        live = world.deployment("llama")
        assert live is not None
        command = vllm_container(live)["command"]
        assert command[command.index("serve") + 1] == MODEL
        world.kubelet_ready(world.new_pod("llama")["metadata"]["name"])
        # the status (a JSON merge patch) records the flags the pod runs, the name among them
        good = wait_for(
            "Ready and the last known good flags",
            lambda: (
                world.condition("llama", "Ready").get("status") == "True"
                and (world.status("llama").get("lastKnownGood") or {}).get("flags")
            ),
        )
        assert good[:2] == ["serve", MODEL]
        assert world.condition("llama", "Degraded").get("reason") != "ApplyRefused"
    # an Event (JSON) with the character in its message, through the operator's own call
    svc = world.svc("llama")
    asyncio.run(k8s.post_event(svc, type="Normal", reason="Utf8Check", message=f"serving {MODEL}"))
    said = [
        e.message for e in world.core.list_namespaced_event(world.ns, field_selector="reason=Utf8Check").items
    ]
    assert said == [f"serving {MODEL}"]
