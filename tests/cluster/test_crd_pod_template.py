"""spec.template on a real kube-apiserver: the embedded PodSpec schema is Kubernetes' own (the
live server's OpenAPI converts to exactly what the CRD holds), `kubectl apply` accepts a real
GPU pod's fields and refuses what rankguard owns with a message naming the field, and the
operator's own parser refuses the same objects (it may run against an older CRD).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from crd_cases import apply, assert_refused_twice, llmservice

from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    path = REPO / "hack" / "pod-template-schema" / "generate.py"
    spec = importlib.util.spec_from_file_location("pod_template_schema", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def service(name: str, **spec: Any) -> dict[str, Any]:
    return llmservice(name, "meta-llama/Llama-3.3-70B-Instruct", **spec)


GPU_POD: dict[str, Any] = {
    "tensorParallelSize": 4,
    "modelCache": {"size": "200Gi", "storageClassName": "fast-rwx", "accessModes": ["ReadWriteMany"]},
    "resources": {"limits": {"memory": "256Gi"}, "sharedMemorySize": "16Gi"},
    "template": {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "runtimeClassName": "nvidia",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "imagePullSecrets": [{"name": "regcred"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["3"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "containers": [
                {
                    "name": "vllm",
                    "env": [
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
                    ],
                }
            ],
        },
    },
}


def with_vllm(**fields: Any) -> dict[str, Any]:
    return {"template": {"spec": {"containers": [{"name": "vllm", **fields}]}}}


# (id, spec changes, what the API server's message names, what the operator's names)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("vllm-image", with_vllm(image="x"), "template.spec.containers[vllm]", "containers[vllm].image"),
    (
        "vllm-resources",
        with_vllm(resources={"limits": {"cpu": "1"}}),
        "template.spec.containers[vllm]",
        "resources",
    ),
    (
        "reserved-env",
        with_vllm(env=[{"name": "CUDA_DEVICE_ORDER", "value": "x"}]),
        "CUDA_DEVICE_ORDER",
        "CUDA_DEVICE_ORDER",
    ),
    ("shm-mount", with_vllm(volumeMounts=[{"name": "x", "mountPath": "/dev/shm"}]), "/dev/shm", "/dev/shm"),
    (
        "hf-home-with-cache",
        {"modelCache": {"claimName": "c"}, **with_vllm(env=[{"name": "HF_HOME", "value": "/x"}])},
        "HF_HOME",
        "HF_HOME",
    ),
    (
        "cache-mount-trailing-slash",
        {
            "modelCache": {"claimName": "c"},
            **with_vllm(volumeMounts=[{"name": "x", "mountPath": "/root/.cache/huggingface/"}]),
        },
        "modelCache.mountPath",
        "mountPath",
    ),
    (
        "shm-over-limit",
        {"resources": {"limits": {"memory": "8Gi"}, "sharedMemorySize": "16Gi"}},
        "sharedMemorySize must not exceed",
        "sharedMemorySize",
    ),
    ("our-volume", {"template": {"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}}, "dshm", "dshm"),
    (
        "sidecar-image",
        {"template": {"spec": {"containers": [{"name": "proxy"}]}}},
        "needs an image",
        "needs an image",
    ),
    (
        "installer-name",
        {"template": {"spec": {"initContainers": [{"name": "rankguard-agent-install", "image": "x"}]}}},
        "rankguard-agent-install",
        "rankguard-agent-install",
    ),
    (
        "our-label",
        {"template": {"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}},
        "labels",
        "labels",
    ),
    (
        "our-annotation",
        {"template": {"metadata": {"annotations": {"rankguard.io/x": "y"}}}},
        "annotations",
        "annotations",
    ),
    ("unknown-pod-field", {"template": {"spec": {"hostPID": True}}}, "hostPID", "hostPID"),
    (
        "cache-both",
        {"modelCache": {"claimName": "c", "size": "1Gi"}},
        "exactly one of claimName",
        "exactly one",
    ),
    (
        "cache-class-with-claim",
        {"modelCache": {"claimName": "c", "storageClassName": "s"}},
        "storageClassName",
        "storageClassName",
    ),
    (
        "core-resource",
        {"resources": {"gpuResourceName": "kubernetes.io/gpu"}},
        "gpuResourceName",
        "gpuResourceName",
    ),
    ("listen", {"listenAddress": "127.0.0.1"}, "listenAddress", "listenAddress"),
]


def test_the_embedded_podspec_is_the_live_api_servers_own(cluster: ControlPlane, crd: str) -> None:
    gen = generator()
    live = json.loads(cluster.kubectl("get", "--raw", "/openapi/v3/api/v1", timeout=120).stdout)
    crd_doc = yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text())
    assert gen.embedded_properties(crd_doc) == gen.template_spec_properties(live), (
        "crds/llmservice.yaml's spec.template.spec is stale: run python hack/pod-template-schema/generate.py"
    )


def test_a_real_gpu_pod_template_is_accepted(cluster: ControlPlane, crd: str, namespace: str) -> None:
    r = apply(cluster, namespace, service("h100", **copy.deepcopy(GPU_POD)))
    assert r.returncode == 0, r.stderr
    stored = json.loads(cluster.kubectl("get", "llmservice", "h100", "-n", namespace, "-o", "json").stdout)[
        "spec"
    ]
    assert stored["template"] == GPU_POD["template"]  # nothing pruned
    assert stored["modelCache"]["mountPath"] == "/root/.cache/huggingface"  # defaulted
    assert stored["listenAddress"] == "0.0.0.0"
    assert stored["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    parse_spec(stored)  # and the operator takes it


@pytest.mark.parametrize(
    ("case", "changes", "server_says", "operator_says"), REFUSED, ids=[c[0] for c in REFUSED]
)
def test_what_rankguard_owns_is_refused_at_apply_and_by_the_operator(  # noqa: PLR0917 - parametrized
    cluster: ControlPlane,
    crd: str,
    namespace: str,
    case: str,
    changes: dict[str, Any],
    server_says: str,
    operator_says: str,
) -> None:
    assert_refused_twice(cluster, namespace, service(case, **changes), server_says, operator_says)


def test_kubectl_explain_shows_the_template(cluster: ControlPlane, crd: str) -> None:
    out = cluster.kubectl("explain", "llmservice.spec.template.spec").stdout
    for field in ("tolerations", "runtimeClassName", "volumes", "imagePullSecrets", "containers"):
        assert field in out
    assert "merged" in out  # our own word for the vllm entry, not Kubernetes' "at least one container"
    tolerations = cluster.kubectl("explain", "llmservice.spec.template.spec.tolerations").stdout
    assert "tolerationSeconds" in tolerations and "taint" in tolerations
