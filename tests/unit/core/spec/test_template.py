"""spec.template, spec.modelCache, spec.resources.{gpuResourceName,sharedMemorySize} and
spec.listenAddress: what the operator refuses (naming the field) and what the rendered pod holds.

The same refusals at `kubectl apply` (the CRD's CEL rules) are held against a real API server
in tests/cluster/test_crd_pod_template.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import TEMPLATE_HASH_ANNOTATION, labels
from rankguard_operator.core.render.claim import render_cache_claim
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec

BASE: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-70B"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 4,
    "engine": {"maxModelLen": 8192},
    "resources": {"limits": {"memory": "96Gi"}},
}
HF_TOKEN = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"example.com/owner": "ml-platform"}},
    "spec": {
        "runtimeClassName": "nvidia",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": "inference",
        "securityContext": {"runAsUser": 0, "fsGroup": 1000},
        "volumes": [{"name": "extra", "configMap": {"name": "chat-templates"}}],
        "initContainers": [{"name": "warm", "image": "busybox:1.37", "command": ["true"]}],
        "containers": [
            {
                "name": "vllm",
                "env": [HF_TOKEN, {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                "envFrom": [{"secretRef": {"name": "more"}}],
                "volumeMounts": [{"name": "extra", "mountPath": "/templates"}],
                "securityContext": {"readOnlyRootFilesystem": False},
            },
            {"name": "proxy", "image": "envoyproxy/envoy:v1.31", "args": ["--config-path", "/etc/e.yaml"]},
        ],
    },
}


def spec_of(**changes: Any) -> ServiceSpec:
    doc = copy.deepcopy(BASE)
    doc.update(copy.deepcopy(changes))
    return parse_spec(doc)


def render(spec: ServiceSpec) -> dict[str, Any]:
    return render_deployment(
        "llama",
        "serving",
        "uid-1",
        spec,
        ServingFlags(kv_cache_memory_bytes=40 * 2**30),
        agent_image="ghcr.io/rankguard/agent:0.1.0",
        plan=prior_plan(spec),
    )


def pod(spec: ServiceSpec) -> dict[str, Any]:
    template = render(spec)["spec"]["template"]
    assert isinstance(template, dict)
    return template


def vllm(spec: ServiceSpec) -> dict[str, Any]:
    [c] = [c for c in pod(spec)["spec"]["containers"] if c["name"] == "vllm"]
    assert isinstance(c, dict)
    return c


# --- what the user's template adds ---------------------------------------------------------------


def test_the_template_is_merged_around_what_rankguard_renders() -> None:
    plain, full = pod(spec_of()), pod(spec_of(template=TEMPLATE))
    ps, fs = plain["spec"], full["spec"]
    # scheduling fields as given
    for key in ("runtimeClassName", "nodeSelector", "priorityClassName"):
        assert fs[key] == TEMPLATE["spec"][key]
    assert fs["tolerations"] == TEMPLATE["spec"]["tolerations"]
    assert fs["imagePullSecrets"] == [{"name": "regcred"}]
    # lists appended after rankguard's
    assert fs["volumes"] == ps["volumes"] + TEMPLATE["spec"]["volumes"]
    assert [c["name"] for c in fs["initContainers"]] == ["rankguard-agent-install", "warm"]
    assert [c["name"] for c in fs["containers"]] == ["vllm", "proxy"]
    assert fs["containers"][1] == TEMPLATE["spec"]["containers"][1]
    # security contexts: the user's keys over rankguard's defaults
    assert fs["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 0,
        "fsGroup": 1000,
    }
    # what rankguard owns is unchanged
    assert fs["enableServiceLinks"] is False and fs["automountServiceAccountToken"] is False
    # labels: ours and the user's; annotations: the user's and ours
    assert full["metadata"]["labels"] == {**labels("llama"), "team": "ml"}
    assert full["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    assert TEMPLATE_HASH_ANNOTATION in full["metadata"]["annotations"]


def test_the_vllm_entry_adds_to_vllms_own_container() -> None:
    plain, full = vllm(spec_of()), vllm(spec_of(template=TEMPLATE))
    assert (
        full["env"] == plain["env"] + TEMPLATE["spec"]["containers"][0]["env"]
    )  # after ours: $(POD_IP) works
    assert full["envFrom"] == [{"secretRef": {"name": "more"}}]
    assert full["volumeMounts"] == plain["volumeMounts"] + [{"name": "extra", "mountPath": "/templates"}]
    assert full["securityContext"] == {**plain["securityContext"], "readOnlyRootFilesystem": False}
    for owned in ("image", "command", "ports", "resources", "readinessProbe", "startupProbe"):
        assert full[owned] == plain[owned]


def test_a_template_change_rolls_the_pods() -> None:
    a = pod(spec_of(template=TEMPLATE))["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
    changed = copy.deepcopy(TEMPLATE)
    changed["spec"]["containers"][0]["env"][1]["value"] = "INFO"
    b = pod(spec_of(template=changed))["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
    assert a != b


def test_no_pythonpath_reaches_the_engine_and_the_agent_runs_by_path() -> None:
    c = vllm(spec_of())
    assert "PYTHONPATH" not in {e["name"] for e in c["env"]}
    assert c["command"][:3] == ["python3", "/opt/rankguard/agent/rankguard-agent", "launch"]
    assert served_argv(pod(spec_of())["spec"])[:2] == ["serve", "meta-llama/Meta-Llama-3-70B"]


# --- model cache, /dev/shm, the GPU resource, listen address -------------------------------------


def test_a_model_cache_claim_is_mounted_with_hf_home() -> None:
    spec = spec_of(modelCache={"claimName": "llama-weights"})
    c, volumes = vllm(spec), pod(spec)["spec"]["volumes"]
    assert {"name": "HF_HOME", "value": "/root/.cache/huggingface"} in c["env"]
    assert {"name": "model-cache", "mountPath": "/root/.cache/huggingface"} in c["volumeMounts"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "llama-weights"}} in volumes
    assert render_cache_claim("llama", "serving", "uid-1", spec) is None  # the user's claim


def test_a_sized_model_cache_is_a_claim_rankguard_owns() -> None:
    spec = spec_of(
        modelCache={
            "size": "200Gi",
            "storageClassName": "fast-rwx",
            "accessModes": ["ReadWriteMany"],
            "mountPath": "/models/",
        }
    )
    claim = render_cache_claim("llama", "serving", "uid-1", spec)
    assert claim is not None
    assert claim["metadata"]["name"] == "llama-model-cache"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "fast-rwx",
    }
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "llama-model-cache"}} in pod(spec)[
        "spec"
    ]["volumes"]
    assert {"name": "HF_HOME", "value": "/models"} in vllm(spec)["env"]


def test_a_long_name_gets_a_claim_name_that_fits() -> None:
    spec = spec_of(modelCache={"size": "10Gi"})
    claim = render_cache_claim("a" * 250, "serving", "uid-1", spec)
    assert claim is not None and len(claim["metadata"]["name"]) <= 253
    assert claim["metadata"]["name"].endswith("-model-cache")


def test_shared_memory_size_and_gpu_resource_name() -> None:
    spec = spec_of(
        resources={
            "limits": {"memory": "96Gi"},
            "sharedMemorySize": "16Gi",
            "gpuResourceName": "nvidia.com/mig-3g.40gb",
        }
    )
    [shm] = [v for v in pod(spec)["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    res = vllm(spec)["resources"]
    assert res["limits"]["nvidia.com/mig-3g.40gb"] == "4" and "nvidia.com/gpu" not in res["limits"]


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_vllm_and_the_agent_listen_on_the_listen_address(address: str) -> None:
    command = vllm(spec_of(listenAddress=address))["command"]
    cut = command.index("--")
    agent, engine = command[:cut], command[cut:]
    assert agent[agent.index("--host") + 1] == address
    assert engine[engine.index("--host") + 1] == address


# --- what is refused, naming the field -----------------------------------------------------------


def vllm_entry(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "vllm", **fields}]}}


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("vllm image", {"template": vllm_entry(image="other")}, "containers[vllm].image"),
    ("vllm args", {"template": vllm_entry(args=["--seed", "1"])}, "spec.engine.extraArgs"),
    (
        "vllm resources",
        {"template": vllm_entry(resources={"limits": {"cpu": "1"}})},
        "containers[vllm].resources",
    ),
    ("vllm probe", {"template": vllm_entry(startupProbe={"exec": {"command": ["true"]}})}, "startupProbe"),
    ("reserved env", {"template": vllm_entry(env=[{"name": "POD_IP", "value": "1"}])}, "cannot set POD_IP"),
    (
        "HF_HOME with a cache",
        {"modelCache": {"claimName": "c"}, "template": vllm_entry(env=[{"name": "HF_HOME", "value": "/x"}])},
        "cannot set HF_HOME",
    ),
    (
        "mount over /dev/shm",
        {"template": vllm_entry(volumeMounts=[{"name": "x", "mountPath": "/dev/shm/"}])},
        "volumeMounts[0].mountPath",
    ),
    (
        "mount over the cache",
        {
            "modelCache": {"claimName": "c"},
            "template": vllm_entry(volumeMounts=[{"name": "x", "mountPath": "/root/.cache/huggingface"}]),
        },
        "volumeMounts[0].mountPath",
    ),
    (
        "our volume name",
        {"template": {"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}},
        "volumes cannot be named 'dshm'",
    ),
    (
        "sidecar without image",
        {"template": {"spec": {"containers": [{"name": "proxy"}]}}},
        "containers[proxy]",
    ),
    (
        "the agent installer's name",
        {"template": {"spec": {"initContainers": [{"name": "rankguard-agent-install", "image": "x"}]}}},
        "rankguard-agent-install",
    ),
    (
        "our label",
        {"template": {"metadata": {"labels": {"rankguard.io/llmservice": "x"}}}},
        "metadata.labels",
    ),
    (
        "our annotation",
        {"template": {"metadata": {"annotations": {"rankguard.io/template-hash": "x"}}}},
        "annotations",
    ),
    ("a field not passed through", {"template": {"spec": {"hostPID": True}}}, "spec.template.spec.hostPID"),
    (
        "duplicate names",
        {"template": {"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "a", "image": "y"}]}}},
        "twice",
    ),
    ("cache: both", {"modelCache": {"claimName": "c", "size": "1Gi"}}, "exactly one of claimName"),
    (
        "cache: class with a claim",
        {"modelCache": {"claimName": "c", "storageClassName": "s"}},
        "storageClassName",
    ),
    ("cache at /dev/shm", {"modelCache": {"size": "1Gi", "mountPath": "/dev/shm"}}, "modelCache.mountPath"),
    (
        "shm over the memory limit",
        {"resources": {"limits": {"memory": "8Gi"}, "sharedMemorySize": "16Gi"}},
        "sharedMemorySize",
    ),
    ("a core resource as GPU", {"resources": {"gpuResourceName": "kubernetes.io/cpu"}}, "gpuResourceName"),
    ("a bare resource name", {"resources": {"gpuResourceName": "gpu"}}, "gpuResourceName"),
    ("listen address", {"listenAddress": "127.0.0.1"}, "spec.listenAddress"),
]


@pytest.mark.parametrize(("case", "changes", "named"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_operator_refuses_what_rankguard_owns(case: str, changes: dict[str, Any], named: str) -> None:
    with pytest.raises(SpecError) as exc:
        spec_of(**changes)
    assert named in str(exc.value), (case, str(exc.value))


def test_the_template_of_a_parsed_spec_stays_hashable() -> None:
    assert hash(spec_of(template=TEMPLATE)) == hash(spec_of(template=copy.deepcopy(TEMPLATE)))


def test_a_slow_first_download_gets_the_start_up_time_it_needs() -> None:
    spec = spec_of(engine={"maxModelLen": 8192, "startupTimeoutSeconds": 7205})
    deployment = render(spec)
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    probe = c["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 7205
    assert probe["failureThreshold"] == 721
    # the Deployment's progress deadline outlasts the probe and the agent's own probe
    assert deployment["spec"]["progressDeadlineSeconds"] == 7210 + 600
    with pytest.raises(SpecError, match="startupTimeoutSeconds"):
        spec_of(engine={"startupTimeoutSeconds": 5})
