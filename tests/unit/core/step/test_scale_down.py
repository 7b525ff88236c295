"""A Failed service holds no GPUs (issue 30): a spec that cannot be served while none of its pods
serves scales the Deployment (or the groups' StatefulSets) to zero, with the same template; a
service that still serves keeps its last good render; the fixed spec scales it back. The pure
step (reconcile.step) in the in-memory cluster, and core/step/scale_down on its own."""

from __future__ import annotations

from typing import Any

from rankguard_operator.core.effects import ApplyDeployment, ApplyObject
from rankguard_operator.core.observe.pods import deployment_template_hash
from rankguard_operator.core.step import scale_down
from tests.builders import owner_ref
from tests.unit.reconcile_world import Cluster, crash_loop, engine_error_record, pod, running

BAD_FLAG = ["--enable-frobnication"]


def failed(c: Cluster) -> dict[str, Any]:
    assert c.status["phase"] == "Failed"
    return next(x for x in c.status["conditions"] if x["type"] == "Degraded")


def test_a_failed_service_with_no_ready_pod_is_scaled_to_zero_and_back() -> None:
    c = running()
    crash_loop(c, engine_error_record(), run=0)  # no ready replica: its pods serve nothing
    c.spec["engine"] = {**c.spec.get("engine", {}), "extraArgs": BAD_FLAG}
    c.generation += 1
    template = deployment_template_hash(c.deployment)
    step = c.run()
    [scaled] = [e for e in step.effects if isinstance(e, ApplyDeployment)]
    assert scaled.body["spec"]["replicas"] == 0
    assert deployment_template_hash(scaled.body) == template  # no rollout: the same pods, none
    assert "status" not in scaled.body and "managedFields" not in scaled.body["metadata"]
    d = failed(c)
    assert d["reason"] == "InvalidSpec" and "enable-frobnication" in d["message"]
    assert scale_down.SCALED_TO_ZERO in d["message"]
    assert c.deployment is not None and c.deployment["spec"]["replicas"] == 0
    # said once: the next pass applies nothing and says nothing new
    again = c.run()
    assert not [e for e in again.effects if isinstance(e, ApplyDeployment)]
    assert failed(c)["message"] == d["message"]
    # the spec fixed: the next pass renders with spec.replicas again
    c.spec["engine"] = {k: v for k, v in c.spec["engine"].items() if k != "extraArgs"}
    c.generation += 1
    back = c.run()
    applied = [e for e in back.effects if isinstance(e, ApplyDeployment)]
    assert applied and applied[-1].body["spec"]["replicas"] == c.spec.get("replicas", 1)


def test_a_serving_service_given_an_invalid_edit_keeps_serving() -> None:
    c = running()
    before = len(c.deployments_applied)
    c.spec["engine"] = {**c.spec.get("engine", {}), "extraArgs": BAD_FLAG}
    c.generation += 1
    step = c.run()
    assert not [e for e in step.effects if isinstance(e, (ApplyDeployment, ApplyObject))]
    assert len(c.deployments_applied) == before
    assert scale_down.KEEPS_SERVING in failed(c)["message"]


def test_pods_still_starting_under_the_last_good_render_are_kept_through_an_invalid_edit() -> None:
    c = Cluster()
    c.run()  # deployed; its pod starts (vLLM loads for minutes): not ready, nothing crashed yet
    assert c.deployment is not None
    annotations = c.deployment["spec"]["template"]["metadata"]["annotations"]
    c.pods = [pod("svc-1", annotations, ready=False)]
    c.deployment["status"] = {"replicas": 1, "readyReplicas": 0}
    c.spec["engine"] = {**c.spec.get("engine", {}), "extraArgs": BAD_FLAG}
    c.generation += 1
    step = c.run()
    assert not [e for e in step.effects if isinstance(e, (ApplyDeployment, ApplyObject))]
    assert scale_down.KEEPS_STARTING in failed(c)["message"]
    # once its vLLM has crashed, the pod will not serve: the workload goes to zero
    crash_loop(c, engine_error_record(), run=0)
    step = c.run()
    [scaled] = [e for e in step.effects if isinstance(e, ApplyDeployment)]
    assert scaled.body["spec"]["replicas"] == 0
    assert scale_down.SCALED_TO_ZERO in failed(c)["message"]


def test_a_budget_the_deployed_render_cannot_run_goes_to_zero_before_any_crash() -> None:
    live = {
        "metadata": {
            "name": "svc",
            "ownerReferences": [owner_ref("LLMService", "uid-1")],
        },
        "spec": {"replicas": 1, "template": {}},
        "status": {"readyReplicas": 0},
    }
    starting = [pod("svc-1", {}, ready=False)]
    assert scale_down.hold_nothing(live, [], "uid-1", starting) == ([], scale_down.KEEPS_STARTING)
    effects, said = scale_down.hold_nothing(live, [], "uid-1", starting, cannot_run=True)
    assert said == scale_down.SCALED_TO_ZERO and [e.body["spec"]["replicas"] for e in effects] == [0]


def test_only_what_the_service_controls_is_scaled() -> None:
    theirs = {
        "metadata": {"name": "svc", "ownerReferences": [{"uid": "other", "controller": True}]},
        "spec": {"replicas": 2},
        "status": {"readyReplicas": 0},
    }
    assert scale_down.hold_nothing(theirs, [], "uid-1") == ([], "")


def test_a_groups_statefulsets_go_to_zero_together() -> None:
    def sts(name: str, replicas: int, ready: int) -> dict[str, Any]:
        return {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "resourceVersion": "9",
                "ownerReferences": [owner_ref("LLMService", "uid-1")],
                "annotations": {"rankguard.io/template-hash": "abc"},
            },
            "spec": {
                "replicas": replicas,
                "serviceName": "svc-pods",
                "template": {"metadata": {"labels": {}}},
            },
            "status": {"readyReplicas": ready},
        }

    effects, said = scale_down.hold_nothing(
        None, [sts("svc-g0-leader", 1, 0), sts("svc-g0-workers", 1, 0)], "uid-1", cannot_run=True
    )
    assert said == scale_down.SCALED_TO_ZERO
    assert [e.body["spec"]["replicas"] for e in effects if isinstance(e, ApplyObject)] == [0, 0]
    assert all("resourceVersion" not in e.body["metadata"] for e in effects if isinstance(e, ApplyObject))
    serving = [sts("svc-g0-leader", 1, 1), sts("svc-g0-workers", 1, 1)]
    assert scale_down.hold_nothing(None, serving, "uid-1") == ([], scale_down.KEEPS_SERVING)
