"""Why a pod does not start, class by class (issue 30): core/observe/pod_blockers on pods,
Deployments, StatefulSets and Events shaped as the API server returns them, then the verdict's
clock, and the step's wiring (Degraded with the class's reason, one Event, cleared when healed)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.observe import pod_blockers as pb
from rankguard_operator.core.step import reconcile
from rankguard_operator.core.units import iso, parse_iso
from tests.unit.reconcile_world import SETTINGS, Cluster, running

T = 1_800_000_000.0  # now, in the tests' clock


def pod(
    *,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    spec: dict[str, Any] | None = None,
    node: str | None = "gpu-node-1",
    conditions: list[dict[str, Any]] | None = None,
    started: float = T - 60,
) -> dict[str, Any]:
    """A serving pod as the kubelet reports it: the agent installer done, vLLM as given."""
    status: dict[str, Any] = {
        "phase": "Pending",
        "startTime": iso(started),
        "conditions": conditions
        if conditions is not None
        else [{"type": "PodScheduled", "status": "True", "lastTransitionTime": iso(started)}],
        "initContainerStatuses": init
        if init is not None
        else [
            {
                "name": "rankguard-agent-install",
                "ready": True,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
            }
        ],
        "containerStatuses": containers or [],
    }
    body_spec = {"containers": [{"name": "vllm"}], **(spec or {})}
    if node:
        body_spec["nodeName"] = node
    return {
        "metadata": {"name": "svc-7d9f-abcde", "uid": "pod-uid-1", "creationTimestamp": iso(started)},
        "spec": body_spec,
        "status": status,
    }


def waiting(name: str, reason: str, message: str | None = None) -> dict[str, Any]:
    w: dict[str, Any] = {"reason": reason}
    if message is not None:
        w["message"] = message
    return {"name": name, "ready": False, "restartCount": 0, "state": {"waiting": w}}


# --------------------------------------------------------------------------------------------
# One class each


def test_env_from_a_missing_secret_is_a_config_error_naming_it() -> None:
    p = pod(containers=[waiting("vllm", "CreateContainerConfigError", 'secret "hf-token" not found')])
    v = pb.pod_verdict(p)
    assert v is not None and v.reason == pb.POD_CONFIG_ERROR
    text = v.message(0)
    assert 'secret \\"hf-token\\" not found' in text or 'secret "hf-token" not found' in text
    assert "pod svc-7d9f-abcde, container vllm" in text and "create the Secret" in text


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_image_pull_errors(reason: str) -> None:
    msg = 'Back-off pulling image "vllm/vllm-openai:v0.99"'
    v = pb.pod_verdict(pod(containers=[waiting("vllm", reason, msg)]))
    assert v is not None and v.reason == pb.IMAGE_PULL_FAILED and msg in v.message(0)


def test_a_volume_the_kubelet_cannot_mount_is_read_from_its_event() -> None:
    """The real kubelet: every container waits with no message; the reason is an Event."""
    p = pod(
        init=[waiting("rankguard-agent-install", "PodInitializing")],
        containers=[waiting("vllm", "PodInitializing")],
    )
    assert pb.pod_verdict(p) is None  # without its Events nothing says why
    assert pb.event_subjects([p], [], T) == ["pod-uid-1"]
    assert pb.event_subjects([p], [], T - 55) == []  # not yet waited MOUNT_WAIT_SECONDS
    said = 'MountVolume.SetUp failed for volume "cfg" : configmap "extra-config" not found'
    event = {
        "type": "Warning",
        "reason": "FailedMount",
        "message": said,
        "count": 7,
        "lastTimestamp": iso(T - 3),
        "involvedObject": {"kind": "Pod", "uid": "pod-uid-1"},
        "source": {"component": "kubelet"},
    }
    stale = {**event, "message": "an old one", "lastTimestamp": iso(T - 5000)}
    v = pb.pod_verdict(p, [stale, event, {**event, "type": "Normal", "reason": "Pulled"}], T)
    assert v is not None and v.reason == pb.VOLUME_MOUNT_FAILED
    assert said in v.message(0) and "(7 times)" in v.message(0) and "an old one" not in v.message(0)
    assert pb.pod_verdict(p, [stale], T) is None


def test_a_failing_init_container_but_not_the_agent_installers_normal_run() -> None:
    installing = pod(
        init=[{"name": "rankguard-agent-install", "ready": False, "state": {"running": {}}}],
        containers=[waiting("vllm", "PodInitializing")],
    )
    assert pb.pod_verdict(installing) is None
    assert (
        pb.pod_verdict(pod(containers=[{"name": "vllm", "ready": False, "state": {"running": {}}}])) is None
    )
    failing = pod(
        init=[
            {
                "name": "rankguard-agent-install",
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
            },
            {
                "name": "fetch-weights",
                "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
                "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": "no such bucket"}},
            },
        ],
        containers=[waiting("vllm", "PodInitializing")],
    )
    v = pb.pod_verdict(failing)
    assert v is not None and v.reason == pb.INIT_CONTAINER_FAILED
    assert "init container fetch-weights" in v.message(0) and "exit code 2" in v.message(0)
    assert "no such bucket" in v.message(0)


def test_an_init_container_running_again_after_a_failure_is_still_failing() -> None:
    """Its runs last a second and its back-offs a few: the verdict must not flicker with them."""
    last = {"terminated": {"exitCode": 1, "reason": "Error"}}
    again = pod(
        init=[{"name": "fetch", "restartCount": 4, "state": {"running": {}}, "lastState": last}],
        containers=[waiting("vllm", "PodInitializing")],
    )
    v = pb.pod_verdict(again)
    assert v is not None and v.reason == pb.INIT_CONTAINER_FAILED and "exit code 1" in v.message(0)
    done = pod(init=[{"name": "fetch", "state": {"terminated": {"exitCode": 0}}, "lastState": last}])
    assert pb.pod_verdict(done) is None  # a retry that succeeded


def test_a_refused_pod_create_from_the_deployment_condition() -> None:
    said = 'pods "svc-7d9f-" is forbidden: no PriorityClass with name gold was found'
    d = {
        "metadata": {"name": "svc", "generation": 2},
        "status": {
            "observedGeneration": 2,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetCreated"},
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": said},
            ],
        },
    }
    v = pb.deployment_verdict(d)
    assert v is not None and v.reason == pb.POD_CREATE_FAILED
    assert said in v.message(0) and "priorityClassName" in v.message(0)


def test_a_statefulset_that_cannot_create_its_pods_says_so_in_an_event() -> None:
    s = {
        "metadata": {"name": "svc-g0-leader", "uid": "sts-uid"},
        "spec": {"replicas": 1},
        "status": {"replicas": 0},
    }
    assert pb.event_subjects([], [s], T) == ["sts-uid"]
    said = (
        'create Pod svc-g0-leader-0 in StatefulSet svc-g0-leader failed error: pods "svc-g0-leader-0" '
        'is forbidden: error looking up service account ns/puller: serviceaccount "puller" not found'
    )
    e = {"type": "Warning", "reason": "FailedCreate", "message": said, "lastTimestamp": iso(T - 1)}
    v = pb.statefulset_verdict(s, [e], T)
    assert v is not None and v.reason == pb.POD_CREATE_FAILED and said in v.message(0)
    full = {**s, "status": {"replicas": 1}}
    assert pb.statefulset_verdict(full, [e], T) is None and pb.event_subjects([], [full], T) == []


def test_no_scheduler_names_the_scheduler() -> None:
    p = pod(node=None, conditions=[], spec={"schedulerName": "gpu-binpacker"})
    v = pb.pod_verdict(p)
    assert v is not None and v.reason == pb.NO_SCHEDULER and '"gpu-binpacker"' in v.message(0)
    # the scheduler's own verdict is observe.blockers' (Unschedulable), not this
    placed_not = pod(
        node=None, conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    )
    assert pb.pod_verdict(placed_not) is None


def test_a_sidecar_never_ready_but_not_vllm_loading() -> None:
    loading = pod(
        containers=[
            {"name": "vllm", "ready": False, "started": True, "state": {"running": {}}},
            {"name": "proxy", "ready": True, "state": {"running": {}}},
        ]
    )
    assert pb.pod_verdict(loading) is None  # vLLM may load weights for many minutes
    probe = {"tcpSocket": {"port": 9}, "initialDelaySeconds": 50, "periodSeconds": 5, "failureThreshold": 4}
    p = pod(
        containers=[
            {"name": "vllm", "ready": True, "state": {"running": {}}},
            {"name": "proxy", "ready": False, "started": True, "state": {"running": {}}},
        ],
        spec={"containers": [{"name": "vllm"}, {"name": "proxy", "readinessProbe": probe}]},
        conditions=[
            {
                "type": "ContainersReady",
                "status": "False",
                "message": "containers with unready status: [proxy]",
            }
        ],
    )
    v = pb.pod_verdict(p)
    assert v is not None and v.reason == pb.SIDECAR_NOT_READY and v.grace == 70.0  # 50 + 5 × 4
    assert "container proxy" in v.message(0) and "containers with unready status: [proxy]" in v.message(0)


def test_vllm_crashes_are_the_policys_not_a_blocker() -> None:
    p = pod(
        containers=[
            {
                "name": "vllm",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
            }
        ]
    )
    assert pb.pod_verdict(p) is None


def test_progress_deadline_only_for_the_spec_the_controller_has_seen() -> None:
    cond = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "x"}
    d = {
        "metadata": {"name": "svc", "generation": 3},
        "status": {"observedGeneration": 3, "conditions": [cond]},
    }
    v = pb.deployment_verdict(d)
    assert v is not None and v.reason == pb.PROGRESS_DEADLINE_EXCEEDED
    d["status"]["observedGeneration"] = 2
    assert pb.deployment_verdict(d) is None


def test_a_long_message_is_bounded_and_folded() -> None:
    huge = "line one\n\n   " + "x" * 5000
    v = pb.pod_verdict(pod(containers=[waiting("vllm", "CreateContainerError", huge)]))
    assert v is not None
    text = v.message(0)
    assert "\n" not in text and len(text) < 1000 and "line one x" in text


# --------------------------------------------------------------------------------------------
# The clock


def test_the_verdict_waits_its_grace_then_holds_and_clears() -> None:
    stuck = [pod(containers=[waiting("vllm", "CreateContainerConfigError", 'secret "hf-token" not found')])]
    first = pb.pod_blockers(stuck, None, T)
    assert first.since == T and first.blocker is None
    assert first.due_in == pytest.approx(pb.GRACE_SECONDS[pb.POD_CONFIG_ERROR])
    later = pb.pod_blockers(stuck, first.since, T + pb.GRACE_SECONDS[pb.POD_CONFIG_ERROR])
    assert later.blocker is not None and later.blocker[0] == pb.POD_CONFIG_ERROR and later.since == T
    healed = pb.pod_blockers([pod(containers=[{"name": "vllm", "state": {"running": {}}}])], T, T + 40)
    assert healed == pb.PodBlockers(None, None)


def test_several_at_once_the_earliest_cause_first() -> None:
    config = pod(containers=[waiting("vllm", "CreateContainerConfigError", "a")])
    other = copy.deepcopy(config)
    other["metadata"]["name"], other["metadata"]["uid"] = "svc-7d9f-zzzzz", "pod-uid-2"
    d = {
        "metadata": {"name": "svc"},
        "status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "message": "quota"}]},
    }
    v = pb.pod_blockers([config, other], T - 100, T, deployment=d)
    assert v.blocker is not None and v.blocker[0] == pb.POD_CREATE_FAILED
    assert "2 more object(s)" in v.blocker[1]


# --------------------------------------------------------------------------------------------
# The step


def degraded(c: Cluster) -> dict[str, Any]:
    return next(x for x in c.status["conditions"] if x["type"] == "Degraded")


def test_the_step_says_a_missing_secret_once_and_clears_it_when_created() -> None:
    c = running()
    annotations = c.pods[0]["metadata"]["annotations"]
    p = pod(containers=[waiting("vllm", "CreateContainerConfigError", 'secret "hf-token" not found')])
    p["metadata"]["annotations"] = dict(annotations)
    c.pods = [p]
    first = c.run()
    assert degraded(c)["status"] == "False" and parse_iso(c.status["stuckSince"]) is not None
    assert first.pass_again_after == pytest.approx(pb.GRACE_SECONDS[pb.POD_CONFIG_ERROR])
    c.clock += pb.GRACE_SECONDS[pb.POD_CONFIG_ERROR]
    steps = [c.run() for _ in range(3)]
    d = degraded(c)
    assert (d["status"], d["reason"]) == ("True", pb.POD_CONFIG_ERROR) and "hf-token" in d["message"]
    assert c.status["phase"] == "Degraded"
    said = [
        e for s in steps for e in s.effects if isinstance(e, PostEvent) and e.reason == pb.POD_CONFIG_ERROR
    ]
    assert len(said) == 1
    c.controller_done()  # the Secret created: the pod runs and turns ready
    c.run()
    assert degraded(c)["status"] == "False" and "stuckSince" not in c.status


def test_the_step_reads_the_events_the_edge_handed_it() -> None:
    c = running()
    p = pod(
        init=[waiting("rankguard-agent-install", "PodInitializing")],
        containers=[waiting("vllm", "PodInitializing")],
    )
    event = {"type": "Warning", "reason": "FailedMount", "message": 'configmap "cfg" not found', "count": 1}
    c.pods = [p]
    state = c.state()
    world = c.world()
    world = type(world)(**{**world.__dict__, "events": {"pod-uid-1": [event]}})
    step = reconcile.step(state, world, SETTINGS)
    c.carry_out_all(step.effects)
    d = degraded(c)
    assert (d["status"], d["reason"]) == ("True", pb.VOLUME_MOUNT_FAILED) and 'configmap "cfg"' in d[
        "message"
    ]


def test_a_pod_as_the_edges_index_keeps_it_still_gives_the_sidecars_probe() -> None:
    """The pod index keeps no spec.containers, only CONTAINERS_KEY (edge/handlers)."""
    probe = {"tcpSocket": {"port": 9}, "initialDelaySeconds": 100}
    p = pod(
        containers=[
            {"name": "vllm", "ready": True, "state": {"running": {}}},
            {"name": "proxy", "ready": False, "state": {"running": {}}},
        ]
    )
    p["spec"] = {"nodeName": "gpu-node-1", "schedulerName": None}
    p[pb.CONTAINERS_KEY] = [{"name": "vllm"}, {"name": "proxy", "readinessProbe": probe}]
    v = pb.pod_verdict(p)
    assert v is not None and v.reason == pb.SIDECAR_NOT_READY and v.grace == 130.0  # 100 + 10 × 3
