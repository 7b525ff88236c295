"""The real LeaderWorkerSet controller (kubernetes-sigs/lws v0.9.0, built by hack/testbin/build.sh,
its webhooks served on 127.0.0.1 with a self-signed certificate: rankguard_sim/kube/lws.py)
makes its StatefulSets and pods from the LeaderWorkerSet rankguard renders, and rankguard's owner
chain (core/observe/ownership) trusts every one of them and finds the groups by LWS's own labels
(core/observe/groups). Before issue 50 the same objects were all `foreign-owner`: the check
below that hands no LWS in shows it. A worker deleted is handled by LWS's own
RecreateGroupOnPodRestart: a new leader pod, a new worker set under it, still trusted.

No kubelet runs in this tier: the pods stay Pending, which is all the chain needs (LWS creates
a group's worker set once its leader pod exists: startupPolicy LeaderCreated). The e2e tier
runs them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from operator_world import GROUP, PLURAL, VERSION, service_doc
from test_lws_dry_run import apply_lws

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import lws_name
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.observe.groups import live_groups
from rankguard_operator.core.render.group import GroupInputs, render_group_set
from rankguard_operator.core.render.leader_worker_set import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kube.lws import SERVED, LwsController
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

SERVICE = "llama-lws"
PODS = 2  # TP 8 on each pod, PP 2 across them
GROUPS = 2
SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-70B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 8,
    "pipelineParallelSize": 2,
    "replicas": GROUPS,
    "distributed": {"podsPerGroup": PODS, "workload": "LeaderWorkerSet"},
}


@pytest.fixture(scope="module")
def lws(cluster: ControlPlane) -> Iterator[LwsController]:
    controller = LwsController.start(cluster)
    try:
        yield controller
    finally:
        controller.stop()
        # the CRDs go too: test_lws_dry_run installs v0.10.0's under the same name
        for crd in SERVED:
            cluster.kubectl("delete", "crd", crd, "--ignore-not-found", "--timeout=60s", check=False)


def rendered(namespace: str, owner_uid: str) -> dict[str, Any]:
    """The LeaderWorkerSet as the operator renders it (core/render/group)."""
    inputs = GroupInputs(parse_spec(SPEC), ServingFlags(kv_cache_memory_bytes=20 * GiB), "agent:1", None)
    doc = render_group_set(SERVICE, namespace, owner_uid, inputs)
    return copy.deepcopy(doc["leaderWorkerSet"])


def family(api: client.ApiClient, namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every StatefulSet and pod in the namespace, as plain dicts."""
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    sets = [api.sanitize_for_serialization(s) for s in apps.list_namespaced_stateful_set(namespace).items]
    pods = [api.sanitize_for_serialization(p) for p in core.list_namespaced_pod(namespace).items]
    return sets, pods


def whole(api: client.ApiClient, namespace: str, name: str) -> bool:
    """Both groups' leader and worker pods exist, none terminating."""
    _, pods = family(api, namespace)
    names = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
    return names == {f"{name}-{g}{suffix}" for g in range(GROUPS) for suffix in ("", "-1")}


def test_the_real_controller_makes_the_groups_and_rankguard_trusts_every_pod(
    api: client.ApiClient, crd: str, namespace: str, lws: LwsController
) -> None:
    owner = client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, service_doc(SERVICE, agent_port=9400)
    )
    service_uid = owner["metadata"]["uid"]
    applied = apply_lws(api, rendered(namespace, service_uid))
    name = lws_name(SERVICE)
    wait_for("LWS's StatefulSets and pods of both groups", lambda: whole(api, namespace, name), 90, every=0.5)
    sets, pods = family(api, namespace)

    # the chain as LWS's controller builds it (read, not assumed: each link's controller)
    by_name = {s["metadata"]["name"]: s for s in sets}
    assert ownership.controller_of(by_name[name]) == ("LeaderWorkerSet", applied["metadata"]["uid"])
    pod_uid = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    for g in range(GROUPS):
        assert ownership.controller_of(by_name[f"{name}-{g}"]) == ("Pod", pod_uid[f"{name}-{g}"])
    # LWS's webhook admitted them: its variables first in the vllm container
    worker = next(p for p in pods if p["metadata"]["name"] == f"{name}-1-1")
    env = [e["name"] for e in worker["spec"]["containers"][0]["env"]][:3]
    assert env == ["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"]

    lws_body = client.CustomObjectsApi(api).get_namespaced_custom_object(
        LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name
    )
    trusted, ignored = ownership.trusted_pods(
        pods, {}, None, service_uid, statefulsets=sets, leader_worker_set=lws_body
    )
    assert ignored == [] and len(trusted) == GROUPS * PODS
    # without the LWS link (the code before issue 50) not one pod counts
    before, _ = ownership.trusted_pods(pods, {}, None, service_uid, statefulsets=sets)
    assert before == []

    owned_sets = ownership.owned_statefulsets(sets, service_uid, leader_worker_set=lws_body, pods=trusted)
    groups = live_groups(owned_sets, trusted, PODS)
    assert sorted(groups.by_index) == list(range(GROUPS))
    for g in range(GROUPS):
        group = groups.get(g)
        assert group is not None and group.template_hash is not None and not group.split
        assert sorted(p["metadata"]["name"] for p in group.pods) == [f"{name}-{g}", f"{name}-{g}-1"]

    # A worker killed: LWS's RecreateGroupOnPodRestart deletes the group's leader, whose worker
    # set goes with it, and makes both again. The finalizer holds the worker as a kubelet's
    # graceful stop would (no kubelet here: a Pending pod is otherwise gone at once).
    core = client.CoreV1Api(api)
    old_leader = pod_uid[f"{name}-1"]
    core.patch_namespaced_pod(
        f"{name}-1-1", namespace, {"metadata": {"finalizers": ["rankguard.io/test-hold"]}}
    )
    core.delete_namespaced_pod(f"{name}-1-1", namespace)
    try:
        wait_for(
            "LWS to delete the group's leader",
            lambda: all(
                p["metadata"]["uid"] != old_leader or p["metadata"].get("deletionTimestamp")
                for p in family(api, namespace)[1]
            ),
            60,
            every=0.5,
        )
    finally:
        core.patch_namespaced_pod(f"{name}-1-1", namespace, {"metadata": {"finalizers": None}})

    def recreated() -> bool:
        _, now = family(api, namespace)
        leader = next((p for p in now if p["metadata"]["name"] == f"{name}-1"), None)
        return leader is not None and leader["metadata"]["uid"] != old_leader and whole(api, namespace, name)

    wait_for("the group recreated by LWS", recreated, 90, every=0.5)
    sets, pods = family(api, namespace)
    trusted, ignored = ownership.trusted_pods(
        pods, {}, None, service_uid, statefulsets=sets, leader_worker_set=lws_body
    )
    assert ignored == [] and len(trusted) == GROUPS * PODS
    new_leader = next(p["metadata"]["uid"] for p in pods if p["metadata"]["name"] == f"{name}-1")
    worker_set = next(s for s in sets if s["metadata"]["name"] == f"{name}-1")
    assert ownership.controller_of(worker_set) == ("Pod", new_leader)
