"""End to end on LeaderWorkerSet (issue 50, point 2): Llama-3.1-70B at TP8 × PP2 over two pods,
one group (a second would only double the sandbox's work: LWS rolls and recreates per group,
and test_multinode covers two groups side by side), `workload: LeaderWorkerSet`, run by the
REAL LWS controller (kubernetes-sigs/lws v0.9.0 from hack/testbin, its webhooks served on
127.0.0.1: rankguard_sim/kube/lws.py), the process kubelet, the agent and the fake vLLM's multi-node protocol.

The story: the groups LWS makes from rankguard's render start and the service turns Ready (before
issue 50 every pod was `foreign-owner` and READY stayed 0); under load a CUDA OOM on a worker is
remediated by rankguard changing the LeaderWorkerSet, which LWS rolls; a worker
killed, LWS's RecreateGroupOnPodRestart recreates its group, and the service is Ready again with
the budget kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from rankguard_operator.core.names import lws_name
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kube.lws import LwsController
from tests.builders import llmservice

from .conftest import apply_service, get_llmservice, ready_groups, serving_pods, wait_for

pytestmark = pytest.mark.e2e

NAME = "llama-lws"
SCENARIO = "llama3-70b-tp8-pp2-2nodes"


@pytest.fixture(scope="module")
def lws_controller(cluster: ControlPlane) -> Iterator[LwsController]:
    with LwsController.start(cluster) as controller:
        yield controller


def _ready_groups(api: client.ApiClient, ns: str, budget: int | None = None) -> dict[str, Any] | None:
    return ready_groups(api, ns, NAME, groups=1, ranks=16, budget=budget)


@pytest.mark.timeout(900)
def test_a_tp8_pp2_service_on_the_real_lws_controller_serves_remediates_and_recreates(
    api: client.ApiClient,
    e2e_namespace: str,
    make_node: Any,
    lws_controller: LwsController,
) -> None:
    ns = e2e_namespace
    make_node(SCENARIO, time_scale=8)
    doc = llmservice(
        NAME,
        {
            "model": {"name": "meta-llama/Llama-3.1-70B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "replicas": 1,
            "tensorParallelSize": 8,
            "pipelineParallelSize": 2,
            "distributed": {"podsPerGroup": 2, "timeoutSeconds": 20, "workload": "LeaderWorkerSet"},
            # the card's own default batch: under full load a last-stage rank runs out at 0.92
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 1024},
            "memory": {"gpuMemoryUtilization": 0.92},
            "remediation": {"cooldownSeconds": 0},
        },
    )
    apply_service(api, ns, doc)
    lws = lws_name(NAME)

    # 1. LWS's pods are trusted: the service measures every rank and, under load, a worker's
    #    CUDA OOM is remediated by a new LeaderWorkerSet template that LWS rolls.
    def remediated() -> dict[str, Any] | None:
        svc = _ready_groups(api, ns)
        rems = ((svc or {}).get("status") or {}).get("remediations") or []
        return svc if any(r["trigger"] == "CUDAOutOfMemory" for r in rems) else None

    svc = wait_for(
        "the groups LWS made Ready, a worker's CUDA OOM remediated",
        remediated,
        480,
        dump=lambda: (get_llmservice(api, ns, NAME).get("status"), sorted(serving_pods(api, ns))),
    )
    st = svc["status"]
    ooms = [r for r in st["remediations"] if r["trigger"] == "CUDAOutOfMemory"]
    assert len(ooms) == 1, ooms  # one cut, one roll of the groups
    assert all(8 <= (r.get("rank") or -1) <= 15 for r in ooms), ooms  # the last stage, on a worker
    budget = st["servingFlags"]["kvCacheMemoryBytes"]
    pods = serving_pods(api, ns)
    assert sorted(pods) == [f"{lws}-0", f"{lws}-0-1"]
    # the roll was LWS's: every pod is of the LeaderWorkerSet's current template
    flags = {str(p.spec.containers[0].args or p.spec.containers[0].command) for p in pods.values()}
    assert all(str(budget) in f for f in flags), flags

    # 2. A worker killed: LWS recreates its group (a new leader pod, a new worker set under it).
    before = {n: p.metadata.uid for n, p in pods.items()}
    client.CoreV1Api(api).delete_namespaced_pod(f"{lws}-0-1", ns)

    def recreated() -> dict[str, Any] | None:
        now = {n: p.metadata.uid for n, p in serving_pods(api, ns).items()}
        if any(now.get(n) in (None, before[n]) for n in before):
            return None
        return _ready_groups(api, ns, budget)

    wait_for(
        "the group recreated by LWS and Ready, budget kept",
        recreated,
        300,
        dump=lambda: (get_llmservice(api, ns, NAME).get("status"), sorted(serving_pods(api, ns))),
    )
