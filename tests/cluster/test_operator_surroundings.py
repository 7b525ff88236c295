"""What surrounds the serving pods, with the real operator on the real API server: the model
cache's PersistentVolumeClaim (named by the user, or created by rankguard), an agent that did
not start (its fallback answering 503 with `agentError`), and the GPU size a node's GPU
Feature Discovery labels state.

The harness is tests/cluster/operator_world.py (its fixtures in conftest.py): the operator in
this process (KopfRunner), watching a namespace of its own; the test plays the kubelet and the
agent. Claims use a storage class no provisioner serves, so they stay Pending until the test
binds a volume of its own to them (whether or not the sandbox runs a provisioner for its
default class).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.rest import ApiException
from operator_world import ReportServer, World, operator, service_doc, valid_report, vllm_container
from prometheus_client import REGISTRY

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.names import cache_claim_name
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import MiB
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

NO_PROVISIONER = "rankguard-test-no-provisioner"  # a storage class nothing provisions
SAYS = "ModuleNotFoundError: No module named 'aiohttp' (rankguard-agent could not start)"


def cache_condition(w: World, name: str, type_: str = "ModelCacheReady") -> tuple[str, str, str]:
    c = w.condition(name, type_)
    return str(c.get("status")), str(c.get("reason")), str(c.get("message"))


def events(w: World, name: str, reason: str) -> list[dict[str, Any]]:
    got = w.core.list_namespaced_event(
        w.ns, field_selector=f"involvedObject.kind=LLMService,involvedObject.name={name}"
    )
    return [w.as_dict(e) for e in got.items if e.reason == reason]


def claim(w: World, name: str) -> dict[str, Any] | None:
    try:
        return w.as_dict(w.core.read_namespaced_persistent_volume_claim(name, w.ns))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


@contextlib.contextmanager
def volume_for(w: World, claim_name: str, size: str = "1Gi") -> Iterator[str]:
    """A PersistentVolume pre-bound to the claim: the PV controller binds the two."""
    name = f"pv-{uuid.uuid4().hex[:8]}"
    w.core.create_persistent_volume(
        {
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": NO_PROVISIONER,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/{name}"},
                "claimRef": {"namespace": w.ns, "name": claim_name},
            },
        }
    )
    try:
        yield name
    finally:
        with contextlib.suppress(ApiException):
            w.core.delete_persistent_volume(name)


def test_a_missing_claim_is_said_then_the_claim_appearing_and_binding_flips_the_condition(
    world: World,
) -> None:
    w, name, wanted = world, "cached", f"weights-{uuid.uuid4().hex[:6]}"
    with operator(w.ns):
        w.create(service_doc(name, free_port(), modelCache={"claimName": wanted}))
        wait_for("ClaimNotFound", lambda: cache_condition(w, name)[1] == "ClaimNotFound")
        status, _, message = cache_condition(w, name)
        assert status == "False"
        assert f"PersistentVolumeClaim {wanted} in namespace {w.ns}" in message
        assert "spec.modelCache.size" in message
        # nothing crash-loops: the loop keeps passing, says it once, and still renders the pods
        w.let_the_loop_look(name)
        assert len(events(w, name, "ModelCacheClaimNotFound")) == 1
        assert w.status(name).get("phase") not in ("Degraded", "Failed")
        deployment = w.deployment(name)
        assert deployment is not None
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": wanted}} in volumes

        w.core.create_namespaced_persistent_volume_claim(
            w.ns,
            {
                "metadata": {"name": wanted},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": NO_PROVISIONER,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        )
        wait_for("ClaimPending", lambda: cache_condition(w, name)[1] == "ClaimPending")
        assert f"storage class {NO_PROVISIONER}" in cache_condition(w, name)[2]

        with volume_for(w, wanted) as pv:
            wait_for("Bound", lambda: cache_condition(w, name)[:2] == ("True", "Bound"), timeout=90)
            assert f"bound to volume {pv}" in cache_condition(w, name)[2]
            assert len(events(w, name, "ModelCacheBound")) == 1
        assert claim(w, wanted) is not None  # the user's claim: rankguard never owns it
        assert not (claim(w, wanted) or {})["metadata"].get("ownerReferences")


def test_size_creates_an_owned_claim_and_a_refused_change_is_apply_refused_not_a_crash(
    world: World,
) -> None:
    w, name = world, "sized"
    cache = {
        "size": "3Gi",
        "storageClassName": NO_PROVISIONER,
        "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
    }
    with operator(w.ns):
        created = w.create(service_doc(name, free_port(), modelCache=cache))
        pvc = wait_for("the claim rankguard creates", lambda: claim(w, cache_claim_name(name)))
        assert pvc["spec"]["resources"]["requests"]["storage"] == "3Gi"
        assert pvc["spec"]["storageClassName"] == NO_PROVISIONER
        assert pvc["spec"]["accessModes"] == ["ReadWriteOnce", "ReadOnlyMany"]
        (owner,) = pvc["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "LLMService",
            created["metadata"]["uid"],
            True,
        )
        assert any(m.get("manager") == "rankguard" for m in pvc["metadata"]["managedFields"])
        wait_for(
            "ClaimPending",
            lambda: (
                cache_condition(w, name)[1] == "ClaimPending"
                and "waiting for a volume" in cache_condition(w, name)[2]
            ),
        )

        # A Pending claim's size cannot change: the API server refuses, the service says so.
        w.custom.patch_namespaced_custom_object(
            "rankguard.io",
            "v1alpha1",
            w.ns,
            "llmservices",
            name,
            {"spec": {"modelCache": {"size": "4Gi"}}},
            _content_type="application/merge-patch+json",
        )
        wait_for("ApplyRefused", lambda: w.condition(name, "Degraded").get("reason") == "ApplyRefused")
        degraded = w.condition(name, "Degraded")
        assert degraded["status"] == "True" and "PersistentVolumeClaim" in degraded["message"]
        w.let_the_loop_look(name)  # retried every pass, and the loop keeps going
        assert w.condition(name, "Degraded").get("reason") == "ApplyRefused"
        assert (claim(w, cache_claim_name(name)) or {})["spec"]["resources"]["requests"]["storage"] == "3Gi"


def agents_unavailable(namespace: str, name: str) -> float | None:
    return REGISTRY.get_sample_value(
        "rankguard_agents_unavailable", {"namespace": namespace, "llmservice": name}
    )


def test_an_agent_that_did_not_start_is_named_with_its_reason_until_it_reports(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANKGUARD_AGENT_UNAVAILABLE_AFTER", "1")
    w, name, port = world, "blind", free_port()
    with ReportServer(port) as agent, operator(w.ns):
        agent.serve(json.dumps({"agentError": SAYS}).encode(), status=503)
        w.create(service_doc(name, port))
        w.ready_service(name)
        pod = w.new_pod(name)["metadata"]["name"]
        w.kubelet_ready(pod)
        wait_for("AgentUnavailable", lambda: cache_condition(w, name, "AgentReady")[1] == "AgentUnavailable")
        status, _, message = cache_condition(w, name, "AgentReady")
        assert (
            status == "False" and pod in message and f'"{SAYS}"' in message and "rankguard-agent:" in message
        )
        wait_for("the gauge", lambda: agents_unavailable(w.ns, name) == 1)
        w.let_the_loop_look(name)
        assert len(events(w, name, "AgentUnavailable")) == 1

        agent.serve(lambda: valid_report((4 << 30, 4 << 30)))
        wait_for("Reporting", lambda: cache_condition(w, name, "AgentReady")[:2] == ("True", "Reporting"))
        assert agents_unavailable(w.ns, name) == 0
        assert len(events(w, name, "AgentsReporting")) == 1


@pytest.fixture
def gpu_node(world: World) -> Iterator[str]:
    """A Node as GPU Feature Discovery labels an H100 node; unschedulable (no kubelet runs it)."""
    name = f"gfd-{uuid.uuid4().hex[:8]}"
    world.core.create_node(
        {
            "metadata": {
                "name": name,
                "labels": {
                    "nvidia.com/gpu.memory": "81559",
                    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                },
            },
            "spec": {
                "unschedulable": True,
                "taints": [{"key": "rankguard.io/test-no-kubelet", "effect": "NoSchedule"}],
            },
        }
    )
    try:
        yield name
    finally:
        with contextlib.suppress(ApiException):
            world.core.delete_node(name)


def kv_flag_of(w: World, name: str) -> int | None:
    d = w.deployment(name)
    command = vllm_container(d)["command"] if d else []
    return (
        int(command[command.index("--kv-cache-memory-bytes") + 1])
        if "--kv-cache-memory-bytes" in command
        else None
    )


def test_a_pod_bound_to_a_node_with_gfd_labels_gets_a_budget_planned_from_them(
    world: World, gpu_node: str
) -> None:
    w, name = world, "labelled"
    with operator(w.ns):
        w.create(service_doc(name, free_port(), memory={}))
        w.ready_service(name)
        assert kv_flag_of(w, name) is None  # no GPU size yet: vLLM's utilisation, no plan
        pod = w.new_pod(name)["metadata"]["name"]
        w.core.create_namespaced_pod_binding(
            pod,
            w.ns,
            {"metadata": {"name": pod}, "target": {"apiVersion": "v1", "kind": "Node", "name": gpu_node}},
            _preload_content=False,
        )
        stored = w.svc(name)["spec"]  # as the API server defaulted it
        spec = parse_spec({**stored, "memory": {**stored.get("memory", {}), "gpuMemoryBytes": 81559 * MiB}})
        plan = prior_plan(spec)
        assert plan is not None
        wait_for(
            "a byte budget planned from the node's label",
            lambda: kv_flag_of(w, name) == plan.kv_cache_memory_bytes,
            dump=lambda: w.status(name),
        )
        assert "gpuMemoryBytes" not in w.status(name)  # status keeps what agents measure
