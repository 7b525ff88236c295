"""vLLM's multi-node options in `engine.extraArgs`, on a real kube-apiserver (issue 50): the
docs (docs/multi-node.md, "Refused at apply") say `kubectl apply` refuses the Ray executor and
the flags rankguard sets per pod of a group, on a one-pod service too; they used to pass apply
and fail later as InvalidSpec. The operator's parser refuses each of them as well (it may run
against an older CRD), and what a one-pod service may set is still accepted.
"""

from __future__ import annotations

from typing import Any

import pytest
from crd_cases import apply, assert_refused_twice, llmservice

from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster

GROUP = {"tensorParallelSize": 8, "pipelineParallelSize": 2, "distributed": {"podsPerGroup": 2}}
MULTI_NODE = "engine.extraArgs must not set vLLM's multi-node options"
RAY = "engine.extraArgs must not choose the Ray executor"

REFUSED: list[tuple[str, list[str], dict[str, Any], str, str]] = [
    # (name, extraArgs, more spec, the API server's words, the operator's)
    ("ray-two-items", ["--distributed-executor-backend", "ray"], {}, RAY, "ray is refused"),
    (
        "ray-one-item",
        ["--enable-prefix-caching", "--distributed-executor-backend=ray"],
        {},
        RAY,
        "ray is refused",
    ),
    ("ray-underscores", ["--distributed_executor_backend", "ray"], {}, RAY, "ray is refused"),
    ("ray-on-a-group", ["--distributed-executor-backend", "ray"], GROUP, RAY, "ray is refused"),
    ("nnodes-one-pod", ["--nnodes", "2"], {}, MULTI_NODE, "--nnodes is refused"),
    ("nnodes-short", ["-n=2"], {}, MULTI_NODE, "-n is refused"),
    ("node-rank-one-pod", ["--node-rank", "1"], {}, MULTI_NODE, "--node-rank is refused"),
    ("master-addr-one-pod", ["--master-addr=leader"], {}, MULTI_NODE, "--master-addr is refused"),
    (
        "nnodes-on-a-group",
        ["--nnodes", "4"],
        GROUP,
        MULTI_NODE,
        "is set by rankguard on every pod of a group",
    ),
    (
        "timeout-on-a-group",
        ["--distributed-timeout-seconds", "600"],
        GROUP,
        "engine.extraArgs must not set --distributed-timeout-seconds on a multi-node service",
        "use spec.distributed.timeoutSeconds",
    ),
]


@pytest.mark.parametrize(
    ("case", "args", "spec", "server_says", "operator_says"), REFUSED, ids=[c[0] for c in REFUSED]
)
def test_multi_node_flags_and_the_ray_executor_are_refused_at_apply_and_by_the_operator(  # noqa: PLR0917 - parametrized
    cluster: ControlPlane,
    crd: str,
    namespace: str,
    case: str,
    args: list[str],
    spec: dict[str, Any],
    server_says: str,
    operator_says: str,
) -> None:
    obj = llmservice(case, "meta-llama/Meta-Llama-3-8B", engine={"extraArgs": args}, **spec)
    assert_refused_twice(cluster, namespace, obj, server_says, operator_says)


@pytest.mark.parametrize(
    "args",
    [
        ["--distributed-executor-backend", "mp"],
        ["--served-model-name", "ray"],  # "ray" as another option's value
        ["--distributed-timeout-seconds", "600"],  # a one-pod service may set vLLM's timeout
    ],
    ids=["mp", "ray-as-a-name", "timeout-one-pod"],
)
def test_what_a_one_pod_service_may_set_is_accepted(
    cluster: ControlPlane, crd: str, namespace: str, args: list[str]
) -> None:
    obj = llmservice(f"ok-{len(args[0])}-{args[1]}", "meta-llama/Meta-Llama-3-8B", engine={"extraArgs": args})
    r = apply(cluster, namespace, obj)
    assert r.returncode == 0, r.stderr
