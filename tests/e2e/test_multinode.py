"""End to end, one model across two pods: Llama-3.1-70B at TP8 × PP2, each replica a group of a
leader and a headless worker (vLLM 0.33's --nnodes), two groups, on the real API server with the
StatefulSet controller, the process kubelet, the agent and the fake vLLM's multi-node protocol.

One story, as a platform engineer running a 2-node vLLM would watch it: the groups start; under
load a CUDA OOM on the headless pod's rank 8 (the last pipeline stage) cuts the budget and both
groups are replaced whole; status names the bottleneck by global rank, pod and stage; a deleted
pod starts its group again with the budget kept; a change of the pod template rolls the two
serving groups one at a time, the budget kept. A watch on every pod checks, at every moment it
sees, that no group runs two sets of flags.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from rankguard_operator.cli_render import shared_flags
from rankguard_operator.core.names import GROUP_LABEL, LLMSERVICE_LABEL, ROLE_LABEL
from rankguard_operator.core.render.pod import served_argv
from rankguard_sim.kube.cluster import ControlPlane
from tests.builders import llmservice

from .conftest import apply_service, get_llmservice, ready_groups, serving_pods, wait_for

pytestmark = pytest.mark.e2e

NAME = "llama-mn"
SCENARIO = "llama3-70b-tp8-pp2-2nodes"


class GroupWatch:
    """Every pod and StatefulSet event of the namespace, in order: the pods each group holds at
    every moment (terminating ones too), and which groups were scaled to zero when."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.ns = api, namespace
        self.pods: dict[str, tuple[str, tuple[str, ...]]] = {}  # name -> (group, flags)
        self.mixed: list[str] = []
        self.down: dict[str, float] = {}  # leader set -> since when at 0 replicas
        self.both_down: list[float] = []  # moments when two groups were down together
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._pods, daemon=True),
            threading.Thread(target=self._sets, daemon=True),
        ]

    def _pods(self) -> None:
        core = client.CoreV1Api(self.api)
        while not self.stop.is_set():
            w = watch.Watch()
            for ev in w.stream(
                core.list_namespaced_pod, self.ns, label_selector=LLMSERVICE_LABEL, timeout_seconds=5
            ):
                pod = ev["object"]
                name = pod.metadata.name
                if ev["type"] == "DELETED":
                    self.pods.pop(name, None)
                else:
                    spec = client.ApiClient().sanitize_for_serialization(pod.spec)
                    group = (pod.metadata.labels or {}).get(GROUP_LABEL, "?")
                    self.pods[name] = (group, tuple(shared_flags(served_argv(spec))))
                self._check(time.monotonic())
                if self.stop.is_set():
                    w.stop()

    def _check(self, at: float) -> None:
        groups: dict[str, set[tuple[str, ...]]] = {}
        for group, flags in self.pods.values():
            groups.setdefault(group, set()).add(flags)
        for group, flag_sets in groups.items():
            if len(flag_sets) > 1:
                self.mixed.append(f"at {at:.1f}: group {group} runs {len(flag_sets)} sets of flags")

    def _sets(self) -> None:
        apps = client.AppsV1Api(self.api)
        while not self.stop.is_set():
            w = watch.Watch()
            for ev in w.stream(
                apps.list_namespaced_stateful_set,
                self.ns,
                label_selector=f"{ROLE_LABEL}=leader",
                timeout_seconds=5,
            ):
                s = ev["object"]
                now = time.monotonic()
                if ev["type"] != "DELETED" and s.spec.replicas == 0:
                    self.down.setdefault(s.metadata.name, now)
                else:
                    self.down.pop(s.metadata.name, None)
                if len(self.down) > 1:
                    self.both_down.append(now)
                if self.stop.is_set():
                    w.stop()

    def __enter__(self) -> GroupWatch:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


@pytest.fixture
def group_watch(api: client.ApiClient, e2e_namespace: str) -> Iterator[GroupWatch]:
    with GroupWatch(api, e2e_namespace) as gw:
        yield gw


def agent_series(pod: client.V1Pod) -> dict[str, float]:
    """The agent's /metrics in `pod` (its container port named "agent" on the pod's IP), one
    value per series name (the capacity series have one sample each)."""
    port = next(p.container_port for c in pod.spec.containers for p in c.ports or () if p.name == "agent")
    url = f"http://{pod.status.pod_ip}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _ready_groups(api: client.ApiClient, ns: str, budget: int | None = None) -> dict[str, Any] | None:
    return ready_groups(api, ns, NAME, groups=2, ranks=16, budget=budget)


# four starts of two groups (the first, the remediation, a recreation, a roll of two)
@pytest.mark.timeout(900)
def test_two_groups_of_two_pods_measured_remediated_restarted_and_rolled_as_groups(
    api: client.ApiClient,
    cluster: ControlPlane,
    e2e_namespace: str,
    make_node: Any,
    group_watch: GroupWatch,
) -> None:
    ns = e2e_namespace
    make_node(SCENARIO, time_scale=4)  # one node with both groups' 32 GPUs
    doc = llmservice(
        NAME,
        {
            "model": {"name": "meta-llama/Llama-3.1-70B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "replicas": 2,
            "tensorParallelSize": 8,
            "pipelineParallelSize": 2,
            # a lost pod stalls its group this long (÷ the sandbox's time scale) before vLLM exits
            "distributed": {"podsPerGroup": 2, "timeoutSeconds": 20},
            # the card's own default batch: under full load rank 8 runs out at vLLM's 0.92
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 1024},
            "memory": {"gpuMemoryUtilization": 0.92},
            "remediation": {"cooldownSeconds": 0},
        },
    )
    apply_service(api, ns, doc)

    # 1. Under load the headless pod's rank 8 runs out; the budget is cut, both groups replaced.
    def remediated() -> dict[str, Any] | None:
        svc = _ready_groups(api, ns)
        st = (svc or {}).get("status") or {}
        rems = st.get("remediations") or []
        # and the load is back on the new groups: the last stage (the logits) is the bottleneck
        # again; just after the groups turn Ready, rank 0's API-server context can be the lowest
        loaded = st.get("bottleneckStage") == 1
        return svc if loaded and any(r["trigger"] == "CUDAOutOfMemory" for r in rems) else None

    svc = wait_for(
        "a CUDA OOM on a worker pod remediated, both groups Ready and loaded",
        remediated,
        420,
        dump=lambda: get_llmservice(api, ns, NAME).get("status"),
    )
    st = svc["status"]
    ooms = [r for r in st["remediations"] if r["trigger"] == "CUDAOutOfMemory"]
    assert all(8 <= (r.get("rank") or -1) <= 15 for r in ooms), ooms  # the last stage, on pod 1
    assert ooms[0]["fromFlags"] == {"gpuMemoryUtilization": 0.92}
    budget = st["servingFlags"]["kvCacheMemoryBytes"]
    assert budget < 0.92 * 79.22 * 2**30

    # 2. Status names the bottleneck by global rank, pod and stage: the last stage, on a worker.
    assert st["bottleneckStage"] == 1 and 8 <= st["bottleneckRank"] <= 15
    assert st["bottleneckPod"].startswith(f"{NAME}-g") and "-w-" in st["bottleneckPod"]
    assert st["bottleneck"] == f"rank {st['bottleneckRank']} (stage 1) on {st['bottleneckPod']}"
    pods_of = {r["rank"]: r["pod"] for r in st["ranks"]}
    assert all("-w-" in pods_of[r] for r in range(8, 16)) and all("-w-" not in pods_of[r] for r in range(8))
    out = cluster.kubectl("get", "llmservice", NAME, "-n", ns).stdout.splitlines()
    assert " 2/2 " in out[1] and f"on {st['bottleneckPod']}" in out[1], out

    # 2b. Capacity for scalers and routers (issue 52): the engine's own KV size, exported once
    # per group by the leader's agent (never by a worker's), and the scale subresource's status.
    assert st["replicas"] == 2 and st["selector"].endswith(f"{ROLE_LABEL}=leader"), st
    assert st["capacity"]["source"] == "engine", st["capacity"]
    pods = serving_pods(api, ns)
    leader, worker = pods[f"{NAME}-g0-0"], pods[f"{NAME}-g0-w-1"]
    exported = agent_series(leader)
    assert exported["rankguard_kv_capacity_tokens"] == st["capacity"]["tokens"], exported
    assert 0 <= exported["rankguard_kv_free_tokens"] <= exported["rankguard_kv_capacity_tokens"]
    assert not {"rankguard_kv_capacity_tokens", "rankguard_kv_free_tokens"} & set(agent_series(worker))

    # 3. A deleted pod starts its group again, as a whole, with the budget kept.
    before = {n: p.metadata.uid for n, p in serving_pods(api, ns).items()}
    client.CoreV1Api(api).delete_namespaced_pod(f"{NAME}-g1-w-1", ns)

    def recreated() -> dict[str, Any] | None:
        now = {n: p.metadata.uid for n, p in serving_pods(api, ns).items()}
        group1 = [n for n in before if n.startswith(f"{NAME}-g1-")]
        if any(now.get(n) in (None, before[n]) for n in group1):
            return None
        return _ready_groups(api, ns, budget)

    wait_for("group 1 recreated whole and Ready, budget kept", recreated, 300)
    now = {n: p.metadata.uid for n, p in serving_pods(api, ns).items()}
    assert all(now[n] == before[n] for n in before if n.startswith(f"{NAME}-g0-")), "group 0 was touched"
    events = client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={NAME}")
    assert any(e.reason == "GroupRecreated" for e in events.items)

    # 4. A change of the pod template rolls the two serving groups one at a time. (Not a budget
    #    input such as maxNumSeqs: that starts again from vLLM's 0.92, where rank 8 may run out
    #    again under load while the other group rolls, and both groups are down by an OOM, not
    #    by the roll.)
    group_watch.both_down.clear()
    roll_started = time.monotonic()
    revision = {"example.com/revision": "2"}
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        "rankguard.io",
        "v1alpha1",
        ns,
        "llmservices",
        NAME,
        {"spec": {"template": {"metadata": {"annotations": revision}}}},
    )

    def rolled() -> dict[str, Any] | None:
        pods = serving_pods(api, ns)
        if len(pods) != 4:
            return None
        if not all(revision.items() <= (p.metadata.annotations or {}).items() for p in pods.values()):
            return None
        return _ready_groups(api, ns, budget)

    wait_for("both groups rolled to the new template and Ready", rolled, 420)
    events = client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={NAME}")
    said = [f"{e.reason}: {e.message}" for e in events.items]
    assert [t for t in group_watch.both_down if t > roll_started] == [], said  # never both down at once
    history = [
        (r["trigger"], r["action"], r.get("fromFlags"), r.get("toFlags"))
        for r in (get_llmservice(api, ns, NAME).get("status") or {}).get("remediations") or []
    ]
    # no moment, from the first pod on, with two sets in one group
    assert group_watch.mixed == [], (group_watch.mixed, history, said)
