"""Across modules: what a person sees of a multi-node service (issue 50, point 8): per-group figures in status
(the tightest rank's headroom and the pods ready of each group, one line per group for
`kubectl describe`), the per-rank lines bounded, and the pod and group in every remediation
record. Against the pure step in the in-memory cluster of tests/unit/core/step/group_world.
"""

from __future__ import annotations

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.units import GiB
from tests.unit.core.step.group_world import GroupCluster, group_report
from tests.unit.reconcile_world import crash_the_pod, running


def test_status_has_each_groups_tightest_rank_and_pods_ready_and_few_rank_lines() -> None:
    c = GroupCluster()
    c.settle()
    at = c.clock
    reports = (
        ("svc-g0-0", group_report("svc-g0-0", range(8), {5: 6 * GiB}, at), at),
        ("svc-g0-w-1", group_report("svc-g0-w-1", range(8, 16), {13: 3 * GiB}, at), at),
        ("svc-g1-0", group_report("svc-g1-0", range(8), {2: 4 * GiB}, at), at),
        ("svc-g1-w-1", group_report("svc-g1-w-1", range(8, 16), {}, at), at),
    )
    c.run(reports=reports)
    st = c.status
    assert st["groupFigures"] == [
        {
            "group": 0,
            "pods": 2,
            "podsReady": 2,
            "tightestRank": 13,
            "tightestPod": "svc-g0-w-1",
            "headroomBytes": 3 * GiB,
            "headroom": "3Gi",
        },
        {
            "group": 1,
            "pods": 2,
            "podsReady": 2,
            "tightestRank": 2,
            "tightestPod": "svc-g1-0",
            "headroomBytes": 4 * GiB,
            "headroom": "4Gi",
        },
    ]
    assert st["perGroup"] == [
        "group 0: 2/2 pods ready, tightest rank 13 (stage 1) on svc-g0-w-1: headroom 3Gi",
        "group 1: 2/2 pods ready, tightest rank 2 (stage 0) on svc-g1-0: headroom 4Gi",
    ]
    # 16 ranks: ranks[] keeps each (tools, metrics); the lines for people are the 8 tightest
    assert len(st["ranks"]) == 16
    lines = st["perRank"]
    assert len(lines) == 9 and lines[-1].startswith("... and 8 more ranks with more headroom")
    assert [line.split(":")[0] for line in lines[:8]][:3] == ["rank 0", "rank 1", "rank 2"]
    assert any(line.startswith("rank 13: headroom 3Gi") for line in lines)


def test_a_group_whose_worker_is_not_ready_says_so() -> None:
    c = GroupCluster()
    c.settle()
    worker = c.pods["svc-g1-w-1"]
    worker["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    c.ready_engines = False
    c.run()
    [g0, g1] = c.status["perGroup"]
    assert g0 == "group 0: 2/2 pods ready, no fresh report"
    assert g1 == "group 1: 1/2 pods ready, no fresh report"


def test_a_remediation_record_names_the_pod_and_its_group() -> None:
    c = GroupCluster()
    c.settle()
    # the worker of group 1 (global ranks 8-15) ran out of memory on rank 13
    worker = c.pods["svc-g1-w-1"]
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=13,
        gpu_index=5,
        nnodes=2,
        node_rank=1,
        requested_bytes=2 * GiB,
        free_bytes=GiB,
        total_bytes=80 * GiB,
        detail="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ).to_json()
    cs = worker["status"]["containerStatuses"][0]
    cs["restartCount"] += 1
    cs["lastState"] = {
        "terminated": {
            "exitCode": 1,
            "reason": "Error",
            "message": message,
            "finishedAt": "2027-01-15T08:00:00Z",
        }
    }
    c.run()
    [entry] = c.status["remediations"]
    assert (entry["trigger"], entry["rank"], entry["pod"], entry["group"]) == (
        "CUDAOutOfMemory",
        13,
        "svc-g1-w-1",
        1,
    )


def test_a_one_pod_services_record_names_the_pod_and_no_group() -> None:
    c = running()
    crash_the_pod(c)
    c.run()
    [entry] = c.status["remediations"]
    assert entry["pod"] == c.pods[0]["metadata"]["name"]
    assert "group" not in entry
    assert "groupFigures" not in c.status and "perGroup" not in c.status
