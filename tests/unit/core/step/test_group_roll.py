"""A multi-node service's groups through `reconcile.step`: rendered as StatefulSets, started,
rolled one group at a time, restarted as a whole, never running two templates in one group.

The StatefulSet controller is tests/unit/core/step/group_world's (Kubernetes' rules for the sets
rankguard renders); every moment it shows is kept and checked.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from rankguard_operator.core.effects import ApplyObject, DeleteObject, PostEvent
from rankguard_operator.core.names import FLAGS_ANNOTATION, POD_INDEX_LABEL
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.step import reconcile
from rankguard_operator.core.step.gather import needs
from rankguard_operator.core.units import GiB
from tests.unit.core.step.group_world import SETTINGS, GroupCluster, group_report, leader_of, role_of


def _argv(p: dict) -> list[str]:
    return served_argv(p["spec"]["template"]["spec"])


def test_a_group_is_two_statefulsets_and_a_headless_service() -> None:
    c = GroupCluster()
    c.run()
    sets = {s["metadata"]["name"]: s for s in c.of_kind("StatefulSet")}
    assert sorted(sets) == ["svc-g0", "svc-g0-w", "svc-g1", "svc-g1-w"]
    leader, workers = sets["svc-g0"], sets["svc-g0-w"]
    assert leader["spec"]["replicas"] == 1 and workers["spec"]["replicas"] == 1
    assert workers["spec"]["ordinals"] == {"start": 1} and "ordinals" not in leader["spec"]
    for s in sets.values():
        assert s["spec"]["podManagementPolicy"] == "Parallel"
        assert s["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert s["spec"]["serviceName"] == "svc-nodes"
    [headless] = c.of_kind("Service")
    assert headless["metadata"]["name"] == "svc-nodes"
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    # the ClusterIP Service sends requests to the leaders only
    assert c.service is not None and c.service["spec"]["selector"]["rankguard.io/role"] == "leader"

    lead, work = _argv(leader), _argv(workers)
    assert lead[lead.index("--nnodes") + 1] == "2" and lead[lead.index("--node-rank") + 1] == "0"
    assert work[work.index("--node-rank") + 1] == "$(RANKGUARD_NODE_RANK)" and "--headless" in work
    assert "--headless" not in lead
    assert lead[lead.index("--master-addr") + 1] == "svc-g0-0.svc-nodes.ns"
    assert (
        _argv(sets["svc-g1-w"])[_argv(sets["svc-g1-w"]).index("--master-addr") + 1] == "svc-g1-0.svc-nodes.ns"
    )
    # the same model and parallel flags on every pod, only the node rank and --headless differ
    strip = {"--headless", "--node-rank", "0", "$(RANKGUARD_NODE_RANK)"}
    assert [a for a in lead if a not in strip] == [a for a in work if a not in strip]

    wc = workers["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in wc["env"]}
    assert env["RANKGUARD_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{POD_INDEX_LABEL}']"
    )
    assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # a headless vLLM answers no HTTP: the worker is ready once its agent listens
    assert "startupProbe" not in wc and "httpGet" not in wc["readinessProbe"]
    assert wc["readinessProbe"]["tcpSocket"] == {"port": "agent"}
    assert {"name": "agent", "containerPort": 9404, "protocol": "TCP"} in wc["ports"]
    lc = leader["spec"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" in lc and lc["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert wc["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_groups_start_then_a_budget_change_rolls_one_serving_group_at_a_time() -> None:
    c = GroupCluster()
    c.settle()
    assert c.groups_ready(), c.pods.keys()
    assert c.status["ready"] == "2/2" and c.status["readyReplicas"] == 2
    first = {p["metadata"]["uid"] for p in c.pods.values()}

    # a new budget (the spec pins one): every group replaced, one at a time, never mixed
    c.spec["memory"] = {"gpuMemoryBytes": 80 * GiB, "kvCacheMemoryBytes": 20 * GiB}
    c.generation += 1
    seen_down: list[list[int]] = []
    for _ in range(60):
        c.run()
        c.tick()
        down = sorted(
            {
                int(s["metadata"]["labels"]["rankguard.io/group"])
                for s in c.of_kind("StatefulSet")
                if s["spec"]["replicas"] == 0
            }
        )
        seen_down.append(down)
        if c.groups_ready() and all(
            json.loads(p["metadata"]["annotations"][FLAGS_ANNOTATION]).get("kvCacheMemoryBytes") == 20 * GiB
            for p in c.pods.values()
        ):
            break
    assert c.groups_ready()
    assert not {p["metadata"]["uid"] for p in c.pods.values()} & first  # every pod replaced
    assert all(len(d) <= 1 for d in seen_down), seen_down  # one group down at a time
    assert [0] in seen_down and [1] in seen_down
    assert c.mixed_moments() == []


def test_a_restarted_container_recreates_its_whole_group_and_keeps_the_budget() -> None:
    c = GroupCluster()
    c.settle()
    flags = c.status["servingFlags"]
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.pods.values()}
    c.restart("svc-g1-w-1")
    step = c.run()
    assert any(isinstance(e, PostEvent) and e.reason == "GroupRecreated" for e in step.effects)
    downs = [
        e.body["metadata"]["name"]
        for e in step.effects
        if isinstance(e, ApplyObject) and e.body["kind"] == "StatefulSet"
    ]
    assert sorted(downs) == ["svc-g1", "svc-g1-w"]
    c.tick()
    c.settle()
    assert c.groups_ready()
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in c.pods.values()}
    assert after["svc-g0-0"] == before["svc-g0-0"] and after["svc-g0-w-1"] == before["svc-g0-w-1"]
    assert after["svc-g1-0"] != before["svc-g1-0"] and after["svc-g1-w-1"] != before["svc-g1-w-1"]
    assert c.status["servingFlags"] == flags
    assert c.mixed_moments() == []


def test_a_lost_pod_recreates_its_group_once() -> None:
    c = GroupCluster()
    c.settle()
    assert c.status["groups"]["0"]["pods"] == {
        "svc-g0-0": c.pods["svc-g0-0"]["metadata"]["uid"],
        "svc-g0-w-1": c.pods["svc-g0-w-1"]["metadata"]["uid"],
    }
    leader_uid = c.pods[leader_of(0)]["metadata"]["uid"]
    c.lose("svc-g0-w-1")  # deleted (evicted): the set makes a new one at once
    c.tick()
    assert c.pods["svc-g0-w-1"]["status"]["containerStatuses"][0]["restartCount"] == 0
    step = c.run()
    assert any(isinstance(e, PostEvent) and e.reason == "GroupRecreated" for e in step.effects)
    c.tick()
    recreations = 1
    for _ in range(30):
        step = c.run()
        recreations += sum(isinstance(e, PostEvent) and e.reason == "GroupRecreated" for e in step.effects)
        c.tick()
        if c.groups_ready():
            break
    assert c.groups_ready() and recreations == 1
    assert c.pods[leader_of(0)]["metadata"]["uid"] != leader_uid
    assert c.mixed_moments() == []


@pytest.mark.parametrize("crash_after", [0, 1, 2, 3])
def test_an_operator_killed_in_the_middle_of_a_group_roll_still_rolls_each_group_once(
    crash_after: int,
) -> None:
    c = GroupCluster()
    c.settle()
    c.spec["memory"] = {"gpuMemoryBytes": 80 * GiB, "kvCacheMemoryBytes": 20 * GiB}
    c.generation += 1
    c.run(crash_after=crash_after)  # dies after `crash_after` effects of the pass that rolls
    c.tick()
    uids_per_pod: dict[str, set[str]] = {}
    for _ in range(60):
        c.run()
        c.tick()
        for p in c.pods.values():
            uids_per_pod.setdefault(p["metadata"]["name"], set()).add(p["metadata"]["uid"])
        if c.groups_ready() and all(
            json.loads(p["metadata"]["annotations"][FLAGS_ANNOTATION]).get("kvCacheMemoryBytes") == 20 * GiB
            for p in c.pods.values()
        ):
            break
    assert c.groups_ready()
    # each pod name had at most its old and its one new incarnation: exactly one roll per group
    assert all(len(u) <= 2 for u in uids_per_pod.values()), uids_per_pod
    assert c.mixed_moments() == []


def test_fewer_replicas_delete_the_groups_beyond_and_none_other() -> None:
    c = GroupCluster()
    c.settle()
    c.spec["replicas"] = 1
    c.generation += 1
    step = c.run()
    deleted = sorted(e.name for e in step.effects if isinstance(e, DeleteObject))
    assert deleted == ["svc-g1", "svc-g1-w"]
    c.tick()
    c.settle()
    assert sorted({p["metadata"]["name"] for p in c.pods.values()}) == ["svc-g0-0", "svc-g0-w-1"]
    assert c.status["ready"] == "1/1"


def test_the_budget_is_the_group_minimum_and_status_names_the_pod_and_stage() -> None:
    c = GroupCluster()
    c.settle()
    at = c.clock
    # pod 1 of group 0 holds ranks 8-15 (the last stage); its rank 13 has the least headroom
    reports = (
        ("svc-g0-0", group_report("svc-g0-0", range(8), {}, at), at),
        ("svc-g0-w-1", group_report("svc-g0-w-1", range(8, 16), {13: 3 * GiB}, at), at),
    )
    c.run(reports=reports)
    st = c.status
    assert st["bottleneckRank"] == 13 and st["bottleneckStage"] == 1 and st["bottleneckPod"] == "svc-g0-w-1"
    assert st["bottleneck"] == "rank 13 (stage 1) on svc-g0-w-1"
    assert {r["rank"]: r["pod"] for r in st["ranks"]}[13] == "svc-g0-w-1"
    assert {r["rank"]: r["stage"] for r in st["ranks"]}[3] == 0


def test_a_service_that_becomes_multi_node_drops_its_deployment() -> None:
    c = GroupCluster()
    single = copy.deepcopy(c.spec)
    del single["distributed"]
    c.spec = single
    c.run()
    assert c.deployment is not None and c.deployment["kind"] == "Deployment"
    c.spec = copy.deepcopy(GroupCluster().spec)
    c.generation += 1
    step = c.run()
    assert [(e.kind, e.name) for e in step.effects if isinstance(e, DeleteObject)] == [("Deployment", "svc")]
    assert c.deployment is None and len(c.of_kind("StatefulSet")) == 4
    # and back: the groups go when the block is removed, and their headless Service, before
    # the Deployment is applied (core/step/keep: the old shape's GPUs are freed first)
    c.spec = single
    c.generation += 1
    step = c.run()
    assert sorted(e.name for e in step.effects if isinstance(e, DeleteObject)) == [
        "svc-g0",
        "svc-g0-w",
        "svc-g1",
        "svc-g1-w",
        "svc-nodes",
    ]
    kinds = [type(e).__name__ for e in step.effects]
    assert kinds.index("ApplyDeployment") > max(i for i, k in enumerate(kinds) if k == "DeleteObject")


def test_roles_are_labelled_on_every_pod() -> None:
    c = GroupCluster()
    c.settle()
    assert {p["metadata"]["name"]: role_of(p) for p in c.pods.values()} == {
        "svc-g0-0": "leader",
        "svc-g0-w-1": "worker",
        "svc-g1-0": "leader",
        "svc-g1-w-1": "worker",
    }


def test_every_pod_of_a_group_is_scraped_the_workers_too() -> None:
    c = GroupCluster()
    c.settle()
    w = c.world()
    targets = needs(w.spec, w.name, deployment=None, pods=w.pods, statefulsets=w.statefulsets).targets
    assert sorted(t[0] for t in targets) == ["svc-g0-0", "svc-g0-w-1", "svc-g1-0", "svc-g1-w-1"]
    assert needs(w.spec, w.name, deployment=None, pods=w.pods).targets == ()  # no set, no template to trust


def test_a_group_seen_half_replaced_is_finished_and_no_serving_group_goes_down_beside_it() -> None:
    """The watches can show one of a group's two sets before the other (or an operator died
    between the two applies): the group counts as starting, so a serving group stays up."""
    c = GroupCluster()
    c.settle()
    old = {s["metadata"]["name"]: copy.deepcopy(s["spec"]) for s in c.statefulsets()}
    c.spec["engine"]["maxNumSeqs"] = 512
    c.generation += 1
    c.run()  # group 0's two sets go to zero with the new template
    seen = c.world()
    for s in seen.statefulsets:
        if s["metadata"]["name"] == "svc-g0-w":
            s["spec"] = old["svc-g0-w"]  # the workers' set as it was
    step = reconcile.step(c.state(), dataclasses.replace(seen), SETTINGS)
    applied = sorted(e.body["metadata"]["name"] for e in step.effects if isinstance(e, ApplyObject))
    assert applied == ["svc-g0", "svc-g0-w"]  # group 0 finished; group 1 left serving


def test_a_group_serving_nothing_is_replaced_at_once_and_a_serving_one_waits_for_it() -> None:
    c = GroupCluster()
    c.settle()
    c.spec["engine"]["maxNumSeqs"] = 512
    c.generation += 1
    for p in c.group_pods(1):  # group 1 serves nothing (its leader is not ready)
        p["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    step = c.run()
    applied = sorted(
        e.body["metadata"]["name"]
        for e in step.effects
        if isinstance(e, ApplyObject) and e.body["kind"] == "StatefulSet"
    )
    assert applied == ["svc-g1", "svc-g1-w"]  # group 0 keeps serving until group 1 is back


@pytest.mark.parametrize(
    ("status", "empty"),
    [
        ({"observedGeneration": 2, "replicas": 0}, True),
        # the controller still counts a pod the pod watch has not shown yet
        ({"observedGeneration": 2, "replicas": 1}, False),
        # the controller has not seen the scale-down: it may still create an old-template pod
        ({"observedGeneration": 1, "replicas": 0}, False),
        ({}, False),
    ],
)
def test_a_scaled_down_group_is_empty_only_when_its_sets_controller_counts_no_pod(
    status: dict[str, int], empty: bool
) -> None:
    from rankguard_operator.core.observe.groups import LiveGroup

    def sts(name: str, st: dict[str, int]) -> dict[str, object]:
        return {"metadata": {"name": name, "generation": 2}, "spec": {"replicas": 0}, "status": st}

    done = {"observedGeneration": 2, "replicas": 0}
    group = LiveGroup(index=0, size=2, leader=sts("g0-l", done), workers=sts("g0-w", status), pods=())
    assert group.scaled_down
    assert group.empty is empty
    other = LiveGroup(index=0, size=2, leader=sts("g0-l", status), workers=sts("g0-w", done), pods=())
    assert other.empty is empty


def test_a_group_with_default_memory_settings_starts_and_its_template_stays_put() -> None:
    """No spec.memory: the GPU's size comes only from the nodes' GPU Feature Discovery labels,
    and only while a pod runs on them. A group replace scales every set to zero, so the render
    must stand on what status kept, or the template flips back and forth between a render with
    the size and one without, each replacing the group again (seen: generation 178 in 10 min)."""
    c = GroupCluster()
    c.spec.pop("memory")
    c.spec["replicas"] = 1  # one group: while it is replaced no pod runs anywhere
    c.node_labels = {
        "node-1": {"nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    }
    c.settle(passes=80)
    assert c.groups_ready(), sorted(c.pods)
    assert c.status["nodeGpu"] == {
        "bytes": 81559 * 1024 * 1024,
        "mig": False,
        "node": "node-1",
        "resource": "nvidia.com/gpu",
    }
    leaders = [p for p in c.pods.values() if role_of(p) == "leader"]
    templates = {json.dumps(p["metadata"]["annotations"], sort_keys=True) for p in leaders}
    assert len(templates) == 1
    generations = dict(c.generations)
    for _ in range(20):  # nothing left to do: no set changes again
        c.run()
        c.tick()
    assert c.generations == generations
    assert c.groups_ready()
    # the GPU's size stood in the render from the first pass the labels were seen on: at most
    # one replace for learning it (the first render had no pod to read a node from)
    assert max(generations.values()) <= 4, generations
