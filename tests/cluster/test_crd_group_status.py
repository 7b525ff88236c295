"""The status fields a person reads of a multi-node service (issue 50), on a real kube-apiserver:
`groupFigures`, `perGroup`, and the pod and group of a remediation record (in
`remediations[]` and in the pending intent's `record`) are declared by the CRD, so the API
server keeps them rather than pruning them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from crd_cases import apply, llmservice

from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster

RECORD = {
    "time": "2026-01-01T00:01:00Z",
    "trigger": "CUDAOutOfMemory",
    "action": "ShrinkKVCache",
    "rank": 13,
    "pod": "svc-g1-w-1",
    "group": 1,
    "from": 65169653760,
    "to": 61374136320,
    "message": "rank 13 ran out of GPU memory in pod svc-g1-w-1",
}
STATUS: dict[str, Any] = {
    "phase": "Running",
    "groupFigures": [
        {
            "group": 0,
            "pods": 2,
            "podsReady": 2,
            "tightestRank": 13,
            "tightestPod": "svc-g0-w-1",
            "headroomBytes": 3 * 2**30,
            "headroom": "3Gi",
        },
        {"group": 1, "pods": 2, "podsReady": 1},
    ],
    "perGroup": [
        "group 0: 2/2 pods ready, tightest rank 13 (stage 1) on svc-g0-w-1: headroom 3Gi",
        "group 1: 1/2 pods ready, no fresh report",
    ],
    "remediations": [RECORD],
    "pendingRemediation": {
        "id": "r-2",
        "kind": "shrink",
        "startedAt": "2026-01-01T00:02:00Z",
        "record": {**RECORD, "time": "2026-01-01T00:02:00Z"},
    },
}


def test_group_figures_and_where_a_remediation_happened_survive_the_api_server(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    obj = llmservice(
        "grouped",
        "meta-llama/Llama-3.1-70B-Instruct",
        tensorParallelSize=8,
        pipelineParallelSize=2,
        distributed={"podsPerGroup": 2},
    )
    assert apply(cluster, namespace, obj).returncode == 0
    r = cluster.kubectl(
        "patch", "llmservice", "grouped", "-n", namespace, "--type=merge", "--subresource=status",
        "-p", json.dumps({"status": STATUS}), check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    stored = json.loads(cluster.kubectl("get", "llmservice", "grouped", "-n", namespace, "-o", "json").stdout)
    status = stored["status"]
    assert status["groupFigures"] == STATUS["groupFigures"]
    assert status["perGroup"] == STATUS["perGroup"]
    assert (status["remediations"][0]["pod"], status["remediations"][0]["group"]) == ("svc-g1-w-1", 1)
    record = status["pendingRemediation"]["record"]
    assert (record["pod"], record["group"]) == ("svc-g1-w-1", 1)
    # and `kubectl describe` shows one line per group
    described = cluster.kubectl("describe", "llmservice", "grouped", "-n", namespace).stdout
    lines = described.split("\nStatus:", 1)[1].split("Per Group:", 1)[1].splitlines()[1:3]
    assert [line.strip() for line in lines] == STATUS["perGroup"], described
