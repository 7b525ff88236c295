"""End to end: the serving pod as a platform engineer runs it on a real GPU cluster. A tainted
GPU node, a RuntimeClass, an HF token in a Secret and a model cache on a PersistentVolume; the
pod the operator rolls carries exactly those fields, the kubelet honours them, and a
remediation roll finds the weights in the cache instead of downloading them again. An agent
bundle that cannot start does not take serving down, and the LLMService says so."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from rankguard_operator.core.model.catalog import CATALOG_ENTRIES
from rankguard_sim.fake_vllm.sandbox import engine_pynvml, weight_downloads
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.world import Node

from .conftest import apply_service, condition, example, get_llmservice, wait_for

pytestmark = pytest.mark.e2e

BUILTIN_SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "rankguard_sim" / "scenarios"

TOKEN = "hf_e2e_not_a_real_token"
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _gpu_world(api: client.ApiClient, ns: str, node: Node) -> None:
    """What a GPU cluster has before anyone applies an LLMService."""
    core = client.CoreV1Api(api)
    core.patch_node(node.name, {"spec": {"taints": [TAINT]}})
    core.patch_node(node.name, {"metadata": {"labels": {"example.com/pool": "h100"}}})
    core.create_namespaced_secret(
        ns, client.V1Secret(metadata=client.V1ObjectMeta(name="hf"), string_data={"token": TOKEN})
    )
    core.create_namespaced_config_map(
        ns,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="chat"), data={"template.jinja": "{{ messages }}"}
        ),
    )
    node_api = client.NodeV1Api(api)
    try:
        node_api.create_runtime_class(
            client.V1RuntimeClass(metadata=client.V1ObjectMeta(name="nvidia"), handler="nvidia")
        )
    except client.ApiException as e:
        if e.status != 409:  # another test made it: cluster-scoped
            raise


TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "ml"}},
    "spec": {
        "runtimeClassName": "nvidia",
        "nodeSelector": {"example.com/pool": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "chat", "configMap": {"name": "chat"}}],
        "containers": [
            {
                "name": "vllm",
                "env": [
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                    {"name": "CHAT_TEMPLATE", "value": "/etc/chat/template.jinja"},
                ],
                "volumeMounts": [{"name": "chat", "mountPath": "/etc/chat", "readOnly": True}],
            }
        ],
    },
}


def _vllm_logs(node: Node, ns: str) -> list[Path]:
    """Every run of every vllm container of the namespace's pods on `node`, oldest first."""
    logs = list((node.kubelet.workdir / "pods").glob(f"{ns}_*/containers/vllm/*.log"))
    return sorted(logs, key=lambda p: p.stat().st_mtime)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _serving_pod(api: client.ApiClient, ns: str) -> client.V1Pod:
    pods = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector="app.kubernetes.io/name=vllm").items
    ready = [
        p for p in pods if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]
    assert len(ready) == 1, [p.metadata.name for p in pods]
    return ready[0]


def _downloading_scenario(folder: Path) -> str:
    """The demo's world (rank 0 runs out under vLLM's default utilisation), with the model's
    published config.json, so the fake vLLM downloads its checkpoint into the HF cache."""
    config = folder / "llama-3-70b-instruct.config.json"
    config.write_text(json.dumps(CATALOG_ENTRIES["llama-3-70b"]["config"]))
    scenario = folder / "llama3-70b-tp4-download.yaml"
    scenario.write_text(
        f"{BUILTIN_SCENARIOS.joinpath('llama3-70b-tp4.yaml').read_text()}\nmodel_config: {config}\n"
    )
    return str(scenario)


def test_a_gpu_pod_with_a_model_cache_is_rolled_without_downloading_again(
    api: client.ApiClient, cluster: ControlPlane, e2e_namespace: str, make_node: Any, tmp_path: Path
) -> None:
    node = make_node(_downloading_scenario(tmp_path), time_scale=4)
    _gpu_world(api, e2e_namespace, node)
    doc = example()
    name = doc["metadata"]["name"]
    doc["spec"]["template"] = TEMPLATE
    doc["spec"]["modelCache"] = {"size": "300Gi", "storageClassName": "rankguard-sim-local"}
    doc["spec"]["resources"] = {"sharedMemorySize": "8Gi"}
    started = time.monotonic()
    apply_service(api, e2e_namespace, doc)

    def remediated_and_ready() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, name)
        ready, cache = condition(svc, "Ready"), condition(svc, "ModelCacheReady")
        rems = (svc.get("status") or {}).get("remediations") or []
        if ready and ready["status"] == "True" and cache and cache["status"] == "True" and rems:
            return svc
        return None

    wait_for(
        "a remediation roll, a Ready service and a bound model cache",
        remediated_and_ready,
        300,
        dump=lambda: get_llmservice(api, e2e_namespace, name).get("status"),
    )
    took = time.monotonic() - started

    # The Deployment carries exactly the user's fields around rankguard's.
    pod_spec = (
        client.AppsV1Api(api)
        .read_namespaced_deployment(name, e2e_namespace)
        .to_dict()["spec"]["template"]["spec"]
    )
    assert pod_spec["runtime_class_name"] == "nvidia"
    assert pod_spec["node_selector"] == {"example.com/pool": "h100"}
    assert pod_spec["tolerations"] == [
        {
            "key": "nvidia.com/gpu",
            "operator": "Exists",
            "effect": "NoSchedule",
            "value": None,
            "toleration_seconds": None,
        }
    ]
    claim = f"{name}-model-cache"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["model-cache"]["persistent_volume_claim"]["claim_name"] == claim
    assert volumes["dshm"]["empty_dir"]["size_limit"] == "8Gi"
    pvc = client.CoreV1Api(api).read_namespaced_persistent_volume_claim(claim, e2e_namespace)
    assert pvc.status.phase == "Bound" and pvc.metadata.owner_references[0].kind == "LLMService"
    pv = client.CoreV1Api(api).read_persistent_volume(pvc.spec.volume_name)

    # The kubelet honoured them: the engine process has the Secret's token, HF_HOME on the
    # claim's volume, and the ConfigMap's file where the template mounted it.
    pod = _serving_pod(api, e2e_namespace)
    envs = [_environ(pid) for pid in node.kubelet.pod_pids(e2e_namespace, pod.metadata.name)]
    engine = next(e for e in envs if e.get("HF_TOKEN"))
    assert engine["HF_TOKEN"] == TOKEN
    assert Path(engine["HF_HOME"]).resolve() == Path(pv.spec.host_path.path).resolve()
    assert Path(engine["CHAT_TEMPLATE"]).read_text() == "{{ messages }}"
    assert (Path(engine["HF_HOME"]) / "hub").is_dir()  # the weights live on the volume

    # The weights were downloaded once: by the first run; the rolled pod found them cached.
    logs = _vllm_logs(node, e2e_namespace)
    downloads = [p for p in logs if weight_downloads(p.read_text(errors="replace"))]
    assert len(logs) >= 2 and downloads == logs[:1], [
        p.parent.parent.parent.name + "/" + p.name for p in logs
    ]
    print(f"\nready after a remediation roll in {took:.0f}s; {len(logs)} vLLM runs, 1 download")

    # The engine imports the image's pynvml, never the agent bundle's copy.
    serving_log = node.kubelet.log_path(e2e_namespace, pod.metadata.name, "vllm")
    assert serving_log is not None
    where = engine_pynvml(serving_log.read_text(errors="replace"))
    assert where, "the fake vLLM did not say where pynvml came from"
    assert "rankguard-agent" not in where and "/pods/" not in where, where


def test_an_agent_that_cannot_start_leaves_vllm_serving_and_says_so(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    node = make_node("llama3-70b-tp4", time_scale=4)
    # every pod of this service gets a broken bundle (a roll installs it again)
    node.kubelet.inject_start_env("rankguard-agent-install", 100, {"RANKGUARD_SIM_AGENT_BUNDLE": "broken"})
    doc = example()
    name = doc["metadata"]["name"]
    doc["spec"]["agent"] = {"probe": False}
    doc["spec"]["memory"] = {"kvCacheMemoryBytes": 20 * 2**30}  # a budget that fits: no OOM to fix
    apply_service(api, e2e_namespace, doc)

    def agent_missing() -> dict[str, Any] | None:
        svc = get_llmservice(api, e2e_namespace, name)
        agent = condition(svc, "AgentReady")
        st = svc.get("status") or {}
        if agent and agent["status"] == "False" and st.get("ready") == "1/1":
            return agent
        return None

    agent = wait_for(
        "vLLM Ready and the agent reported missing",
        agent_missing,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, name).get("status"),
    )
    assert agent["reason"] == "AgentUnavailable"
    assert "rankguard_agent.server" in agent["message"]  # the fallback's own words: the missing module
    pod = _serving_pod(api, e2e_namespace)
    log = node.kubelet.log_path(e2e_namespace, pod.metadata.name, "vllm")
    assert log is not None
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("rankguard-agent:")]
    assert len(lines) == 1 and "running the engine without rankguard" in lines[0]
    assert "Traceback" not in log.read_text(errors="replace").split("rankguard-agent:")[0]
