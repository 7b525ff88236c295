"""The operator's remediations against the real API server, under kopf's KopfRunner: a CUDA OOM
rolls once to a smaller budget, a delivery seen again or an operator restarted at any point
between the decision and the patch never rolls twice, and an OOMKill raises the memory limit.
The harness is operator_world.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from operator_world import (
    HOLD_FINALIZER,
    MERGE,
    GiB,
    MiB,
    World,
    cuda_oom,
    kv_flag,
    now_iso,
    operator,
    service_doc,
    vllm_container,
)

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import DEFAULT_AGENT_IMAGE, FLAGS_ANNOTATION, REMEDIATION_ID_ANNOTATION
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import parse_bytes
from rankguard_operator.edge import k8s
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster


# --------------------------------------------------------------------------------------------
# 1. CUDA OOM on rank 0: one roll with a smaller budget, one Event, one history entry, then Ready


def test_cuda_oom_on_rank0_rolls_once_to_a_smaller_budget_then_ready(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        world.ready_service("svc")
        before = world.deployment("svc")
        assert before is not None
        old_kv, generation = kv_flag(before), int(before["metadata"]["generation"])
        pod = world.new_pod("svc")["metadata"]["name"]

        # rank 0 asked for 2 GiB with 1.5 GiB free: a 512 MiB deficit, plus the default 512 MiB
        # safety margin, so the budget must drop by at least 1 GiB (rounded down to whole blocks).
        world.kubelet_terminated(pod, cuda_oom(rank=0, requested=2 * GiB, free=3 * GiB // 2))
        rolled = wait_for(
            "the Deployment to roll",
            lambda: (d := world.deployment("svc")) and d["metadata"]["generation"] > generation and d,
        )
        new_kv = kv_flag(rolled)
        assert old_kv - GiB - 64 * MiB < new_kv <= old_kv - GiB, (old_kv, new_kv)
        assert rolled["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION]

        status = wait_for(
            "the remediation in status",
            lambda: (s := world.status("svc")).get("remediations") and not s.get("pendingRemediation") and s,
        )
        [entry] = status["remediations"]
        assert entry["trigger"] == "CUDAOutOfMemory" and entry["action"] == "ShrinkKVCache"
        assert entry["rank"] == 0
        assert entry["fromFlags"]["kvCacheMemoryBytes"] == old_kv
        assert entry["toFlags"]["kvCacheMemoryBytes"] == new_kv
        assert status["servingFlags"] == {"kvCacheMemoryBytes": new_kv}
        remediating = world.condition("svc", "Remediating")
        assert remediating["status"] == "True", remediating
        assert status["phase"] == "Remediating"
        events = wait_for("the Warning Event", lambda: world.warning_events("svc"))
        assert [e["reason"] for e in events] == ["ShrinkKVCache"]
        assert "rank 0 ran out of GPU memory" in events[0]["message"]

        # The kubelet starts the new pod and it becomes Ready: the service is Ready again.
        new_pod = world.new_pod("svc", not_in=(pod,))
        assert kv_flag({"spec": {"template": {"spec": new_pod["spec"]}}}) == new_kv  # the new template
        world.kubelet_ready(new_pod["metadata"]["name"])
        wait_for("Ready True", lambda: world.condition("svc", "Ready").get("status") == "True")
        status = world.status("svc")
        assert status["phase"] == "Running"
        assert world.condition("svc", "Remediating")["status"] == "False"
        assert status["ready"] == "1/1"

        # Still exactly one roll, one history entry and one Warning Event.
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1
        assert len(world.status("svc")["remediations"]) == 1
        assert [e["reason"] for e in world.warning_events("svc")] == ["ShrinkKVCache"]


# --------------------------------------------------------------------------------------------
# 2. The same termination delivered again: no second roll


def test_the_same_termination_delivered_again_does_not_roll_again(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        world.ready_service("svc")
        generation = world.generation("svc")
        pod = world.new_pod("svc")["metadata"]["name"]
        # Stands for the kubelet's graceful termination: the deleted pod (and its status) stays
        # visible for a while after the roll, and keeps sending events.
        world.patch_pod(pod, {"metadata": {"finalizers": [HOLD_FINALIZER]}})

        # First as the kubelet reports a run the moment it ends: in `state`, restartCount 0.
        oom = cuda_oom(rank=0, requested=2 * GiB, free=GiB)
        world.kubelet_terminated(pod, oom, restarted=False)
        wait_for("the roll", lambda: world.generation("svc") == generation + 1)
        wait_for("the old pod to be terminating", lambda: world.pod(pod)["metadata"].get("deletionTimestamp"))
        wait_for("the status", lambda: not world.status("svc").get("pendingRemediation"))

        # The same run again, as reported after the restart (lastState, restartCount 1), on a pod
        # whose metadata changed: a new event for the same termination.
        world.patch_pod(pod, {"metadata": {"annotations": {"example.com/touched": "1"}}})
        world.kubelet_terminated(pod, oom, restarted=True)
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1

        # Once more, with the pod no longer saying which flags it ran: only the record of handled
        # terminations (status.handledTerminations) now stands between this event and a roll.
        world.patch_pod(
            pod, {"metadata": {"annotations": {FLAGS_ANNOTATION: None, "example.com/touched": "2"}}}
        )
        world.kubelet_terminated(pod, oom, restarted=True)
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1
        status = world.status("svc")
        assert len(status["remediations"]) == 1
        uid = world.pod(pod)["metadata"]["uid"]
        assert f"{uid}/vllm/0" in status["handledTerminations"]
        assert [e["reason"] for e in world.warning_events("svc")] == ["ShrinkKVCache"]
        world.patch_pod(pod, {"metadata": {"finalizers": None}}, content_type=MERGE)


# --------------------------------------------------------------------------------------------
# 3. The operator restarted between the decision and the patch: exactly one roll


def pending_remediation(
    rid: str, from_flags: ServingFlags, to_flags: ServingFlags, key: str
) -> dict[str, Any]:
    """What a crashed operator leaves: the decision, written before the roll it never made."""
    return {
        "id": rid,
        "kind": "shrink",
        "startedAt": now_iso(),
        "fromFlags": from_flags.to_status(),
        "toFlags": to_flags.to_status(),
        "terminations": [key],
    }


def test_restart_between_the_decision_and_the_patch_rolls_exactly_once(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        status = world.ready_service("svc")
        pod = world.new_pod("svc")
    current = ServingFlags.from_status(status["servingFlags"])
    assert current is not None and current.kv_cache_memory_bytes is not None
    target = current.with_kv(current.kv_cache_memory_bytes - 2 * GiB)
    key = f"{pod['metadata']['uid']}/vllm/0"
    generation = world.generation("svc")
    world.patch_status("svc", {"pendingRemediation": pending_remediation("rg-0001", current, target, key)})

    with operator(world.ns):
        status = wait_for(
            "the pending remediation to be finished",
            lambda: (s := world.status("svc")) and not s.get("pendingRemediation") and s,
        )
        world.let_the_loop_look("svc")
        rolled = world.deployment("svc")
        assert rolled is not None
        assert rolled["metadata"]["generation"] == generation + 1
        assert rolled["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == "rg-0001"
        assert kv_flag(rolled) == target.kv_cache_memory_bytes
        status = world.status("svc")
        assert status["servingFlags"] == target.to_status()
        assert key in status["handledTerminations"]
        assert "pendingRemediation" not in status
        replica_sets = world.apps.list_namespaced_replica_set(world.ns).items
        assert len(replica_sets) == 2  # the first render and the one roll


def test_restart_after_the_patch_does_not_roll_again(world: World) -> None:
    with operator(world.ns):
        created = world.create(service_doc("svc", free_port()))
        status = world.ready_service("svc")
        pod = world.new_pod("svc")
    current = ServingFlags.from_status(status["servingFlags"])
    assert current is not None and current.kv_cache_memory_bytes is not None
    target = current.with_kv(current.kv_cache_memory_bytes - 2 * GiB)
    key = f"{pod['metadata']['uid']}/vllm/0"
    world.patch_status("svc", {"pendingRemediation": pending_remediation("rg-0002", current, target, key)})
    # The crashed operator had already rolled: the Deployment it applied carries the id.
    spec = parse_spec(world.svc("svc")["spec"])
    applied = render_deployment(
        "svc",
        world.ns,
        created["metadata"]["uid"],
        spec,
        target,
        agent_image=DEFAULT_AGENT_IMAGE,
        plan=prior_plan(spec),
        revision_annotations={REMEDIATION_ID_ANNOTATION: "rg-0002"},
    )
    world.apps.patch_namespaced_deployment(
        "svc",
        world.ns,
        applied,
        field_manager=k8s.FIELD_MANAGER,
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    generation = world.generation("svc")

    with operator(world.ns):
        wait_for(
            "the pending remediation to be cleared", lambda: not world.status("svc").get("pendingRemediation")
        )
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation
        live = world.deployment("svc")
        assert live is not None and kv_flag(live) == target.kv_cache_memory_bytes
        status = world.status("svc")
        assert status["servingFlags"] == target.to_status()
        assert key in status["handledTerminations"]


def test_crash_after_writing_the_decision_is_finished_by_the_next_operator(world: World) -> None:
    """The same story with the real decision: the operator writes its intent, then its roll is
    refused by the API server (a ValidatingAdmissionPolicy, as a cluster's own policy might)
    until it is stopped; the next operator rolls exactly once and records the change."""
    admission = client.AdmissionregistrationV1Api(world.api)
    policy_name = f"refuse-rankguard-rolls-{world.ns}"
    admission.create_validating_admission_policy(
        {
            "metadata": {"name": policy_name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["UPDATE"],
                         "resources": ["deployments"]}
                    ]
                },
                "validations": [
                    {
                        "expression": "!has(object.metadata.annotations) || "
                        f"!('{REMEDIATION_ID_ANNOTATION}' in object.metadata.annotations)",
                        "message": "remediation rolls are frozen in this namespace",
                    }
                ],
            },
        }
    )  # fmt: skip
    admission.create_validating_admission_policy_binding(
        {
            "metadata": {"name": policy_name},
            "spec": {
                "policyName": policy_name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world.ns}}
                },
            },
        }
    )
    # Admission policies take effect a moment after they are created: wait until one bites.
    world.apps.create_namespaced_deployment(
        world.ns,
        {
            "metadata": {"name": "vap-probe"},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "vap-probe"}},
                "template": {
                    "metadata": {"labels": {"app": "vap-probe"}},
                    "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
                },
            },
        },
    )

    def refused() -> bool:
        try:
            world.apps.patch_namespaced_deployment(
                "vap-probe",
                world.ns,
                {"metadata": {"annotations": {REMEDIATION_ID_ANNOTATION: "x"}}},
                dry_run="All",
            )
        except ApiException as e:
            return e.status in (400, 403, 422)
        return False

    wait_for("the admission policy to take effect", refused)
    try:
        with operator(world.ns):
            world.create(service_doc("svc", free_port()))
            world.ready_service("svc")
            generation = world.generation("svc")
            pod = world.new_pod("svc")["metadata"]["name"]
            world.kubelet_terminated(pod, cuda_oom(rank=0, requested=3 * GiB, free=GiB))
            pending = wait_for(
                "the decision in status", lambda: world.status("svc").get("pendingRemediation")
            )
            # The refusal is on the LLMService, in the API server's words (before: logged every
            # pass, with no condition and no Event).
            degraded = wait_for(
                "the refusal as a condition",
                lambda: (c := world.condition("svc", "Degraded")).get("reason") == "ApplyRefused" and c,
            )
            assert degraded["status"] == "True"
            assert "remediation rolls are frozen in this namespace" in degraded["message"]
            world.let_the_loop_look("svc")
            refusals = [e for e in world.warning_events("svc") if e["reason"] == "ApplyRefused"]
            assert len(refusals) == 1, refusals  # once, not once per pass
            assert world.status("svc")["pendingRemediation"]["id"] == pending["id"]  # the same one
        assert world.generation("svc") == generation  # the roll never landed
        assert not world.status("svc").get("remediations")  # nor was it recorded as done
    finally:
        admission.delete_validating_admission_policy_binding(policy_name)
        admission.delete_validating_admission_policy(policy_name)

    with operator(world.ns):
        wait_for(
            "the pending remediation to be finished",
            lambda: not world.status("svc").get("pendingRemediation"),
        )
        world.let_the_loop_look("svc")
        rolled = world.deployment("svc")
        assert rolled is not None
        assert rolled["metadata"]["generation"] == generation + 1
        assert rolled["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == pending["id"]
        assert kv_flag(rolled) == pending["toFlags"]["kvCacheMemoryBytes"]
        assert kv_flag(rolled) < pending["fromFlags"]["kvCacheMemoryBytes"]
        st = world.status("svc")
        assert st["servingFlags"] == pending["toFlags"]
        # Recorded once, under the id of the roll, even though the deciding operator died.
        assert [h["revision"] for h in st["remediations"]] == [pending["id"]]
        assert st["remediations"][0]["trigger"] == "CUDAOutOfMemory"


# --------------------------------------------------------------------------------------------
# 4. OOMKilled: the container memory limit is raised the way the VPA does


def test_oomkilled_raises_the_memory_limit(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        world.ready_service("svc")
        before = world.deployment("svc")
        assert before is not None
        generation = world.generation("svc")
        pod = world.new_pod("svc")["metadata"]["name"]
        # The kernel killed the container at its limit; the launcher could write nothing, so the
        # kubelet fell back to the log tail (FallbackToLogsOnError).
        world.kubelet_terminated(
            pod,
            {
                "exitCode": 137,
                "reason": "OOMKilled",
                "message": "INFO 11-29 22:00:00 Loading safetensors checkpoint shards: 50% Completed | 2/4",
            },
        )
        rolled = wait_for(
            "the memory limit to be raised",
            lambda: (d := world.deployment("svc")) and d["metadata"]["generation"] > generation and d,
        )
        resources = vllm_container(rolled)["resources"]
        # 32Gi limit: max(32Gi + 100Mi, 32Gi × 1.2 = 39321.6Mi), rounded up to whole MiB.
        assert parse_bytes(resources["limits"]["memory"]) == 39322 * MiB
        assert resources["requests"]["memory"] == "16Gi"
        assert resources["limits"]["nvidia.com/gpu"] == "2"
        assert kv_flag(rolled) == kv_flag(before)  # GPU memory had nothing to do with it
        status = wait_for("the history entry", lambda: (s := world.status("svc")).get("remediations") and s)
        [entry] = status["remediations"]
        assert entry["trigger"] == "OOMKilled" and entry["action"] == "BumpMemoryLimit"
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1
