"""End to end: the operator, the agent and the fake vLLM on a simulated node, through the real
API server. Each test tells one story a platform engineer would recognise."""

from __future__ import annotations

import os
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.budget.kv_model import min_budget_for_one_request
from rankguard_operator.core.model.resolve import resolve
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kubelet.kubelet import wait_for_pids_gone
from tests.builders import llmservice

from .conftest import GROUP, PLURAL, VERSION, apply_service, condition, example, get_llmservice, wait_for

pytestmark = pytest.mark.e2e


def _ready(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    svc = get_llmservice(api, ns, name)
    c = condition(svc, "Ready")
    st = svc.get("status") or {}
    if c and c["status"] == "True" and st.get("ranks") and st.get("minHeadroom"):
        return svc
    return None


def test_rank0_oom_is_remediated_to_ready_with_headroom(
    api: client.ApiClient, cluster: ControlPlane, e2e_namespace: str, make_node: Any
) -> None:
    make_node("llama3-70b-tp4", time_scale=4)
    doc = example()
    apply_service(api, e2e_namespace, doc)
    name = doc["metadata"]["name"]

    def remediated_and_ready() -> dict[str, Any] | None:
        svc = _ready(api, e2e_namespace, name)
        rems = (svc or {}).get("status", {}).get("remediations") or []
        return svc if any(r["trigger"] == "CUDAOutOfMemory" for r in rems) else None

    svc = wait_for(
        "a CUDA OOM remediation and a Ready service",
        remediated_and_ready,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, name).get("status"),
    )
    st = svc["status"]
    ooms = [r for r in st.get("remediations", []) if r["trigger"] == "CUDAOutOfMemory"]
    assert ooms[-1]["rank"] == 0
    # From vLLM's one-fraction-for-every-rank default to an explicit per-GPU budget below it.
    assert ooms[-1]["fromFlags"] == {"gpuMemoryUtilization": 0.92}
    assert ooms[-1]["toFlags"]["kvCacheMemoryBytes"] < 0.92 * 79.14 * 2**30
    # The remediation did not need a second one: it held under load.
    assert len(ooms) == 1
    assert len(st["ranks"]) == 4
    assert st["bottleneckRank"] == 0 and st["bottleneck"] == "rank 0"
    assert all(r["headroomBytes"] > 0 for r in st["ranks"])
    assert st["budget"]["kvCacheMemoryBytes"] == ooms[-1]["toFlags"]["kvCacheMemoryBytes"]

    out = cluster.kubectl("get", "llmservice", name, "-n", e2e_namespace).stdout
    header, row = out.splitlines()[:2]
    assert header.split()[:12] == [
        "NAME", "MODEL", "TP", "PP", "PODS", "READY", "KV-BUDGET", "RANK0", "MIN-HEADROOM", "BOTTLENECK",
        "PHASE", "AGE",
    ]  # fmt: skip
    cells = row.split()  # PODS is empty for one pod per replica: no cell
    assert cells[4] == "1/1" and cells[5].endswith("Gi") and cells[6].endswith(("Gi", "Mi"))
    events = client.CoreV1Api(api).list_namespaced_event(
        e2e_namespace, field_selector=f"involvedObject.name={name},involvedObject.kind=LLMService"
    )
    assert any("ran out of GPU memory" in (e.message or "") for e in events.items)


def test_pipeline_terminal_rank_is_the_bottleneck_and_the_budget_follows_it(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("tp2-pp2", time_scale=4)
    doc = llmservice(
        "pp",
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 2,
            "pipelineParallelSize": 2,
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 64},
            "memory": {"gpuMemoryBytes": 25769803776},
            "remediation": {"cooldownSeconds": 30},
        },
    )
    apply_service(api, e2e_namespace, doc)

    def ready_and_stages_differ() -> dict[str, Any] | None:
        # Right after a start every rank can show the same idle figure (a tie, which names rank
        # 0); the pipeline-terminal stage shows its extra memory once traffic reaches it. Wait
        # for what the story is about: Ready, with the agents' figures telling the stages apart.
        svc = _ready(api, e2e_namespace, "pp")
        ranks = (svc or {}).get("status", {}).get("ranks") or []
        fresh = [r for r in ranks if not r.get("stale")]
        return svc if len(fresh) == 4 and len({r["minFreeBytes"] for r in fresh}) > 1 else None

    svc = wait_for(
        "the PP service to be Ready, its stages' headroom apart",
        ready_and_stages_differ,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "pp").get("status"),
    )
    st = svc["status"]
    assert st["bottleneckRank"] != 0, st["ranks"]
    assert st["bottleneckRank"] in (2, 3)  # the pipeline-terminal stage
    crashes = [r for r in st.get("remediations", []) if r["trigger"] == "CUDAOutOfMemory"]
    assert all(r.get("rank") in (2, 3) for r in crashes), crashes


def test_oomkilled_raises_the_memory_limit_until_running(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("host-oomkilled", time_scale=4)
    doc = llmservice(
        "hostmem",
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 1,
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 256},
            "memory": {"gpuMemoryBytes": 85060306944},
            "remediation": {"cooldownSeconds": 0, "maxHostMemory": "64Gi"},
            # A limit that fits the engine at rest but not the weights staged while loading.
            "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
        },
    )
    apply_service(api, e2e_namespace, doc)
    svc = wait_for("the memory limit raised and Ready", lambda: _ready(api, e2e_namespace, "hostmem"), 240)
    raises = [r for r in svc["status"]["remediations"] if r["trigger"] == "OOMKilled"]
    assert raises, svc["status"].get("remediations")
    # the whole container was killed, the launcher too; what it had left in the termination log
    # says where the engine was: staging the weights
    assert raises[0].get("phase") == "weights", raises[0]
    assert "OOMKilled while loading the weights" in raises[0]["message"], raises[0]
    dep = client.AppsV1Api(api).read_namespaced_deployment("hostmem", e2e_namespace)
    limit = dep.spec.template.spec.containers[0].resources.limits["memory"]
    assert limit != "16Gi"


def test_deleting_the_service_removes_everything_and_leaves_no_process(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    node = make_node("llama3-70b-tp4", time_scale=4)
    doc = example()
    doc["metadata"]["name"] = "gone"
    apply_service(api, e2e_namespace, doc)
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    wait_for("a running pod", node.kubelet.all_pids, 120)
    pids = node.kubelet.all_pids()
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        "rankguard.io", "v1alpha1", e2e_namespace, "llmservices", "gone"
    )
    wait_for(
        "the Deployment, Service and pods to be collected",
        lambda: (
            not apps.list_namespaced_deployment(e2e_namespace).items
            and not [
                s for s in core.list_namespaced_service(e2e_namespace).items if s.metadata.name == "gone"
            ]
            and not core.list_namespaced_pod(e2e_namespace).items
        ),
        120,
    )
    assert wait_for_pids_gone(pids, timeout=20) == []
    assert node.kubelet.all_pids() == []
    assert not node.kubelet.gpu_assignments()
    leftovers = [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert leftovers == []


def test_a_roll_that_fails_for_a_non_memory_reason_is_rolled_back(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    node = make_node("llama3-70b-tp4", time_scale=4)
    doc = example()
    doc["metadata"]["name"] = "rb"
    del doc["spec"]["memory"]["gpuMemoryUtilization"]  # rankguard plans from the start
    apply_service(api, e2e_namespace, doc)

    def known_good() -> dict[str, Any] | None:
        svc = _ready(api, e2e_namespace, "rb")
        if not svc:
            return None
        st = svc["status"]
        lkg = (st.get("lastKnownGood") or {}).get("kvCacheMemoryBytes")
        return svc if lkg and lkg == st["servingFlags"]["kvCacheMemoryBytes"] else None

    good = wait_for(
        "Ready with last-known-good flags recorded",
        known_good,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "rb").get("status"),
    )["status"]["servingFlags"]

    # The node's driver breaks for the next start of a vLLM container (nothing to do with memory),
    # and a person changes the safety margin, so rankguard re-plans and rolls the Deployment.
    node.kubelet.inject_start_faults("vllm", 1, "CUDA error: uncorrectable ECC error encountered")
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        "rankguard.io", "v1alpha1", e2e_namespace, "llmservices", "rb",
        {"spec": {"memory": {"safetyMarginBytes": 1073741824}}},
    )  # fmt: skip

    seen_degraded: list[str] = []

    def rolled_back_and_ready() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, "rb")
        deg = condition(svc, "Degraded")
        if deg and deg["status"] == "True":
            seen_degraded.append(deg.get("message", ""))
        rbs = [r for r in (svc.get("status") or {}).get("remediations", []) if r.get("action") == "Rollback"]
        return svc if rbs and _ready(api, e2e_namespace, "rb") else None

    svc = wait_for(
        "a rollback to the last known good flags, then Ready",
        rolled_back_and_ready,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "rb").get("status"),
    )
    st = svc["status"]
    rb = [r for r in st["remediations"] if r.get("action") == "Rollback"][-1]
    assert rb["trigger"] == "EngineError"
    assert rb["toFlags"] == good
    assert st["servingFlags"] == good
    assert "ECC" in rb["message"] and "last known good" in rb["message"]
    assert any("roll" in m.lower() for m in seen_degraded), seen_degraded


def test_an_extra_args_item_vllm_would_refuse_is_refused_and_nothing_is_rolled(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    make_node("llama3-70b-tp4", time_scale=4)
    doc = example()
    doc["metadata"]["name"] = "args"
    apply_service(api, e2e_namespace, doc)
    apps = client.AppsV1Api(api)

    def deployed() -> Any:
        items = apps.list_namespaced_deployment(e2e_namespace).items
        return items[0] if items else None

    before = wait_for("the Deployment", deployed, 120)
    custom = client.CustomObjectsApi(api)
    # an owned option behind an alias is refused at apply time by the CRD's rule
    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, e2e_namespace, PLURAL, "args",
            {"spec": {"engine": {"extraArgs": ["--device-memory-utilization", "0.5"]}}},
        )  # fmt: skip
    assert refused.value.status == 422 and "rankguard manages" in str(refused.value.body)
    # "--max-num-seqs 64" as one item passes the CRD; vLLM would exit 2: the operator refuses it
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, e2e_namespace, PLURAL, "args",
        {"spec": {"engine": {"extraArgs": ["--enable-prefix-caching", "--max-num-seqs 64"]}}},
    )  # fmt: skip

    def invalid() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, "args")
        deg = condition(svc, "Degraded")
        ok = deg and deg["reason"] == "InvalidSpec" and svc["status"].get("observedGeneration") == 2
        return svc if ok else None

    svc = wait_for("InvalidSpec", invalid, 120, dump=lambda: get_llmservice(api, e2e_namespace, "args"))
    message = condition(svc, "Degraded")["message"]  # type: ignore[index]
    assert "spec.engine.extraArgs[1] '--max-num-seqs 64'" in message and "'--max-num-seqs', '64'" in message
    events = client.CoreV1Api(api).list_namespaced_event(
        e2e_namespace, field_selector="involvedObject.name=args,reason=InvalidSpec"
    )
    assert events.items and "--max-num-seqs 64" in (events.items[0].message or "")
    after = deployed()
    assert after.metadata.generation == before.metadata.generation  # nothing rolled
    assert after.spec.template.metadata.annotations == before.spec.template.metadata.annotations


def test_a_budget_at_the_floor_starts(api: client.ApiClient, e2e_namespace: str, make_node: Any) -> None:
    """The smallest budget rankguard ever sets (one request at maxModelLen plus the block vLLM
    0.33 holds back) is one vLLM accepts: pinned there, the service becomes Ready."""
    make_node("tp2-pp2", time_scale=4)
    spec = {
        "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "image": "vllm/vllm-openai:v0.33.0",
        "tensorParallelSize": 2,
        "pipelineParallelSize": 2,
        "engine": {"maxModelLen": 8192, "maxNumSeqs": 8},
    }
    parsed = parse_spec(spec)
    shape = resolve(parsed).shape
    assert shape is not None
    floor = min_budget_for_one_request(shape, 2, max_model_len=8192, pp=2)
    spec["memory"] = {"kvCacheMemoryBytes": floor}
    apply_service(api, e2e_namespace, llmservice("floor", spec))
    svc = wait_for(
        "the service at the floor to be Ready",
        lambda: _ready(api, e2e_namespace, "floor"),
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "floor").get("status"),
    )
    assert svc["status"]["servingFlags"] == {"kvCacheMemoryBytes": floor}
    assert not [r for r in svc["status"].get("remediations") or [] if r["trigger"] == "KVCacheTooSmall"]


def test_small_cards_under_tp_start_without_anyone_typing_the_gpu_size(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    """On 24 GB cards the contexts and NCCL take more than 8 %: vLLM refuses its own default
    0.92 at start-up. No gpuMemoryBytes in the spec: rankguard learns the card's size from the
    refusal and renders a byte budget with a start-up utilisation vLLM accepts."""
    make_node("llama3-8b-tp2-24gb", time_scale=4)
    doc = llmservice(
        "small",
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 2,
            "engine": {"maxModelLen": 8192},
            "remediation": {"cooldownSeconds": 30},
        },
    )
    apply_service(api, e2e_namespace, doc)
    svc = wait_for(
        "the small-card service to be Ready",
        lambda: _ready(api, e2e_namespace, "small"),
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, "small").get("status"),
    )
    st = svc["status"]
    assert st["gpuMemoryBytes"] == round(23.58 * 2**30)
    assert "kvCacheMemoryBytes" in st["servingFlags"]
    assert st["engine"]["version"] == "0.33.0" and st["engine"]["versionSource"] == "agent"
    assert condition(svc, "EngineRules")["status"] == "True"  # type: ignore[index]
    dep = client.AppsV1Api(api).read_namespaced_deployment("small", e2e_namespace)
    argv = dep.spec.template.spec.containers[0].command
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert util < 20.64 / 23.58  # below the free share vLLM measured on GPU 0 at start-up
