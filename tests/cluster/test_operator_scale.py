"""`kubectl scale llmservice` against the real API server and the in-process operator
(operator_world.py): the CRD's scale subresource moves spec.replicas, the operator scales the
Deployment to it without touching the pod template, and `.../scale` reads back the replicas the
workload has and the selector of its serving pods, which the API server itself parses.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from operator_world import GiB, ReportServer, World, operator, service_doc, valid_report

from rankguard_sim.kube.cluster import ControlPlane, free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster


def scale_of(cluster: ControlPlane, world: World, name: str) -> dict[str, Any]:
    """The LLMService's scale subresource, as `kubectl get --subresource=scale` reads it."""
    out = cluster.kubectl("get", "llmservice", name, "-n", world.ns, "--subresource=scale", "-o", "json")
    return dict(json.loads(out.stdout))


def test_kubectl_scale_moves_the_deployment_and_not_its_template(world: World, cluster: ControlPlane) -> None:
    port = free_port()
    with ReportServer(port) as agent, operator(world.ns):
        agent.serve(lambda: valid_report((3 * GiB, 3 * GiB)))
        world.create(service_doc("svc", port))
        world.ready_service("svc")
        first = world.new_pod("svc")["metadata"]["name"]
        world.kubelet_ready(first)
        wait_for("Ready", lambda: world.condition("svc", "Ready").get("status") == "True")
        before = world.deployment("svc")
        assert before is not None
        status = world.status("svc")
        assert status["replicas"] == 1
        selector = status["selector"]
        kept = {k: status.get(k) for k in ("servingFlags", "lastKnownGood", "budgetKey", "remediations")}

        cluster.kubectl("scale", "llmservice", "svc", "-n", world.ns, "--replicas", "3")
        assert world.svc("svc")["spec"]["replicas"] == 3
        after = wait_for(
            "the Deployment scaled to 3",
            lambda: (d := world.deployment("svc")) and d["spec"]["replicas"] == 3 and d,
        )
        assert after["spec"]["template"] == before["spec"]["template"]
        # the ReplicaSet controller adds two pods of the same ReplicaSet; the first keeps serving
        pods = wait_for("3 pods", lambda: len(p := world.pods("svc")) == 3 and p)
        assert len({p["metadata"]["labels"]["pod-template-hash"] for p in pods}) == 1
        assert first in {p["metadata"]["name"] for p in pods}
        # scaling is progress, not a roll, while the new pods start
        wait_for(
            "Progressing Scaling", lambda: world.condition("svc", "Progressing").get("reason") == "Scaling"
        )
        for p in pods:
            if p["metadata"]["name"] != first:
                world.kubelet_ready(p["metadata"]["name"])

        scale = wait_for(
            "status.replicas 3 through the scale subresource",
            lambda: (s := scale_of(cluster, world, "svc")).get("status", {}).get("replicas") == 3 and s,
        )
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        assert scale["status"]["selector"] == selector
        # the API server parses the selector as an HPA does: it picks exactly the service's pods
        picked = cluster.kubectl("get", "pods", "-n", world.ns, "-l", selector, "-o", "name").stdout.split()
        assert sorted(picked) == sorted(f"pod/{p['metadata']['name']}" for p in pods)

        wait_for("READY 3/3", lambda: world.status("svc").get("ready") == "3/3")
        status = world.status("svc")
        assert status["readyReplicas"] == status["replicas"] == 3
        assert {k: status.get(k) for k in kept} == kept
        assert world.condition("svc", "Ready")["status"] == "True"
        wait_for("RolloutComplete", lambda: world.condition("svc", "Progressing").get("status") == "False")
        assert world.condition("svc", "Progressing")["reason"] == "RolloutComplete"
        assert world.warning_events("svc") == []
        assert world.deployment("svc")["spec"]["template"] == before["spec"]["template"]  # type: ignore[index]
