"""Renderers: the full Deployment and Service, vLLM's flags, extraArgs conflicts, the template hash."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.owned_flags import owned_spellings
from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.resolve import resolve
from rankguard_operator.core.names import FLAGS_ANNOTATION, TEMPLATE_HASH_ANNOTATION, labels, selector
from rankguard_operator.core.render.deployment import render_deployment, render_service, template_hash
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.units import GiB

BASE: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-70B"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 4,
    "engine": {"maxModelLen": 8192, "extraArgs": ["--enable-prefix-caching"]},
    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"cpu": "16", "memory": "96Gi"}},
}
KV = 40_460_615_680


def spec_of(**changes: Any) -> ServiceSpec:
    doc = copy.deepcopy(BASE)
    for key, value in changes.items():
        doc[key] = value
    return parse_spec(doc)


def plan_of(spec: ServiceSpec) -> Plan | None:
    """The prior plan the operator renders with (None where the spec needs a ConfigMap read)."""
    try:
        return prior_plan(spec)
    except SpecError:
        return None


def deployment(
    spec: ServiceSpec | None = None, flags: ServingFlags | None = None, **kw: Any
) -> dict[str, Any]:
    return render_deployment(
        "llama",
        "serving",
        "uid-123",
        spec or spec_of(),
        flags or ServingFlags(kv_cache_memory_bytes=KV),
        agent_image="ghcr.io/rankguard/agent:0.1.0",
        plan=plan_of(spec or spec_of()),
        shape=resolve(spec or spec_of()).spec_shape,  # as the step hands it in
        **kw,
    )


EXPECTED_LABELS = {
    "app.kubernetes.io/name": "vllm",
    "app.kubernetes.io/instance": "llama",
    "app.kubernetes.io/managed-by": "rankguard",
    "rankguard.io/llmservice": "llama",
}
OWNER = {
    "apiVersion": "rankguard.io/v1alpha1",
    "kind": "LLMService",
    "name": "llama",
    "uid": "uid-123",
    "controller": True,
    "blockOwnerDeletion": True,
}
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


EXPECTED_COMMAND = [
    "python3", "/opt/rankguard/agent/rankguard-agent", "launch",
    "--port", "9404", "--host", "0.0.0.0",
    "--termination-log", "/dev/termination-log", "--hz", "10",
    "--probe", "--probe-world-size", "4",
    "--probe-hidden-size", "8192", "--probe-vocab-size", "128256",
    "--", "vllm", "serve", "meta-llama/Meta-Llama-3-70B",
    "--tensor-parallel-size", "4",
    "--kv-cache-memory-bytes", "40460615680",
    "--gpu-memory-utilization", "0.5",  # no GPU size in the spec: the start-up check's half card
    "--max-num-seqs", "256",
    "--max-model-len", "8192",
    "--max-num-batched-tokens", "8192",
    "--dtype", "auto",
    "--kv-cache-dtype", "auto",
    "--host", "0.0.0.0", "--port", "8000",
    "--enable-prefix-caching",
]  # fmt: skip


def expected_deployment(hash_: str) -> dict[str, Any]:
    health = {"path": "/health", "port": "http", "scheme": "HTTP"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "llama",
            "namespace": "serving",
            "labels": EXPECTED_LABELS,
            "ownerReferences": [OWNER],
        },
        "spec": {
            "replicas": 1,
            "selector": {
                "matchLabels": {"app.kubernetes.io/name": "vllm", "rankguard.io/llmservice": "llama"}
            },
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 10,
            "progressDeadlineSeconds": 2400,
            "template": {
                "metadata": {
                    "labels": EXPECTED_LABELS,
                    "annotations": {
                        FLAGS_ANNOTATION: '{"kvCacheMemoryBytes":40460615680}',
                        TEMPLATE_HASH_ANNOTATION: hash_,
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": [
                        {
                            "name": "rankguard-agent-install",
                            "image": "ghcr.io/rankguard/agent:0.1.0",
                            "command": ["rankguard-agent-install", "/opt/rankguard/agent"],
                            "volumeMounts": [
                                {"name": "rankguard-agent", "mountPath": "/opt/rankguard/agent"}
                            ],
                            "resources": {
                                "requests": {"cpu": "50m", "memory": "64Mi"},
                                "limits": {"memory": "256Mi"},
                            },
                            "securityContext": {**RESTRICTED, "readOnlyRootFilesystem": True},
                        }
                    ],
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.33.0",
                            "command": EXPECTED_COMMAND,
                            "env": [
                                {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
                                {
                                    "name": "POD_IP",
                                    "valueFrom": {
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}
                                    },
                                },
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}
                                    },
                                },
                                {
                                    "name": "POD_NAMESPACE",
                                    "valueFrom": {
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}
                                    },
                                },
                                {"name": "RANKGUARD_LLMSERVICE", "value": "llama"},
                            ],
                            "ports": [
                                {"name": "http", "containerPort": 8000, "protocol": "TCP"},
                                {"name": "agent", "containerPort": 9404, "protocol": "TCP"},
                            ],
                            "resources": {
                                "requests": {"nvidia.com/gpu": "4", "cpu": "8", "memory": "64Gi"},
                                "limits": {"nvidia.com/gpu": "4", "cpu": "16", "memory": "96Gi"},
                            },
                            "volumeMounts": [
                                {
                                    "name": "rankguard-agent",
                                    "mountPath": "/opt/rankguard/agent",
                                    "readOnly": True,
                                },
                                {"name": "dshm", "mountPath": "/dev/shm"},
                            ],
                            "terminationMessagePath": "/dev/termination-log",
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                            "readinessProbe": {
                                "httpGet": health,
                                "periodSeconds": 2,
                                "failureThreshold": 3,
                                "timeoutSeconds": 2,
                            },
                            "startupProbe": {
                                "httpGet": health,
                                "periodSeconds": 10,
                                "failureThreshold": 180,
                                "timeoutSeconds": 5,
                            },
                            "securityContext": RESTRICTED,
                        }
                    ],
                    "volumes": [
                        {"name": "rankguard-agent", "emptyDir": {}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    ],
                },
            },
        },
    }


def test_deployment_golden() -> None:
    got = deployment()
    hash_ = got["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
    assert len(hash_) == 16 and hash_ == template_hash(got)
    assert got == expected_deployment(hash_)


def test_service_golden() -> None:
    assert render_service("llama", "serving", "uid-123", spec_of()) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "llama",
            "namespace": "serving",
            "labels": EXPECTED_LABELS,
            "ownerReferences": [OWNER],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": {"app.kubernetes.io/name": "vllm", "rankguard.io/llmservice": "llama"},
            "ports": [
                {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
                {"name": "agent", "port": 9404, "targetPort": "agent", "protocol": "TCP"},
            ],
        },
    }


# --- vLLM flags ----------------------------------------------------------------------------------


def test_vllm_args_with_utilisation_pp_and_eager() -> None:
    s = spec_of(
        pipelineParallelSize=2,
        engine={"maxNumSeqs": 64, "kvCacheDtype": "fp8", "enforceEager": True, "extraArgs": ["--seed", "1"]},
    )
    assert vllm_args(s, ServingFlags(gpu_memory_utilization=0.92), prior_plan(s)) == [
        "serve", "meta-llama/Meta-Llama-3-70B",
        "--tensor-parallel-size", "4",
        "--pipeline-parallel-size", "2",
        "--gpu-memory-utilization", "0.92",
        "--max-num-seqs", "64",
        "--max-num-batched-tokens", "8192",
        "--dtype", "auto",
        "--kv-cache-dtype", "fp8",
        "--enforce-eager",
        "--host", "0.0.0.0", "--port", "8000",
        "--seed", "1",
    ]  # fmt: skip


def test_byte_budget_wins_over_utilisation_and_none_renders_no_budget_flag() -> None:
    s = spec_of()
    both = vllm_args(s, ServingFlags(kv_cache_memory_bytes=KV, gpu_memory_utilization=0.9), prior_plan(s))
    # the byte budget, and next to it only the start-up check's share (no plan: half the card)
    assert "--kv-cache-memory-bytes" in both and both[both.index("--gpu-memory-utilization") + 1] == "0.5"
    neither = vllm_args(s, ServingFlags(), prior_plan(s))
    assert "--kv-cache-memory-bytes" not in neither and "--gpu-memory-utilization" not in neither
    assert "--pipeline-parallel-size" not in neither  # pp 1 is vLLM's default; not rendered


@given(
    kv=st.one_of(st.none(), st.integers(1, 1 << 40)),
    util=st.one_of(st.none(), st.floats(0.01, 1.0)),
)
def test_exactly_one_budget_flag_and_it_round_trips(kv: int | None, util: float | None) -> None:
    args = vllm_args(
        spec_of(), ServingFlags(kv_cache_memory_bytes=kv, gpu_memory_utilization=util), prior_plan(spec_of())
    )
    budget = [a for a in args if a in ("--kv-cache-memory-bytes", "--gpu-memory-utilization")]
    if kv is not None:  # the byte budget, and the start-up check's share beside it
        assert budget == ["--kv-cache-memory-bytes", "--gpu-memory-utilization"]
        assert int(args[args.index("--kv-cache-memory-bytes") + 1]) == kv
    elif util is not None:
        assert budget == ["--gpu-memory-utilization"]
        assert float(args[args.index("--gpu-memory-utilization") + 1]) == util
    else:
        assert budget == []


def test_memory_limit_from_flags_overrides_the_spec() -> None:
    res = deployment(flags=ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=120 * GiB))
    limits = res["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == "120Gi"
    ann = res["spec"]["template"]["metadata"]["annotations"][FLAGS_ANNOTATION]
    assert ann == '{"kvCacheMemoryBytes":40460615680,"memoryLimit":"120Gi"}'


def test_request_never_exceeds_the_limit() -> None:
    res = deployment(flags=ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=32 * GiB))
    r = res["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert r["requests"]["memory"] == r["limits"]["memory"] == "32Gi"


def test_agent_options() -> None:
    no_probe = deployment(
        spec_of(agent={"probe": False, "image": "my/agent:2", "port": 9500, "sampleHz": 2.5})
    )
    pod = no_probe["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert "--probe" not in cmd and cmd[cmd.index("--port") + 1] == "9500" and "2.5" in cmd
    assert pod["initContainers"][0]["image"] == "my/agent:2"
    assert pod["containers"][0]["ports"][1] == {"name": "agent", "containerPort": 9500, "protocol": "TCP"}
    # a ConfigMap model: the operator knows the shape only from the caller, so the probe gets no sizes
    cm = deployment(spec_of(model={"name": "acme/m", "configMap": {"name": "cfg"}}))
    cmd = cm["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--probe" in cmd and "--probe-hidden-size" not in cmd


def test_replicas_and_long_names() -> None:
    assert deployment(spec_of(replicas=3))["spec"]["replicas"] == 3
    long = "x" * 100
    lab = labels(long)
    assert all(len(v) <= 63 for v in lab.values()) and lab == labels(long)
    assert selector(long)["rankguard.io/llmservice"] == lab["rankguard.io/llmservice"]
    assert labels("y" * 100) != lab
    assert len(render_service(long, "ns", "u", spec_of())["metadata"]["name"]) <= 63


# --- the template hash ---------------------------------------------------------------------------


def test_hash_is_stable_and_ignores_non_template_fields() -> None:
    a, b = deployment(), deployment()
    assert template_hash(a) == template_hash(b)
    # scaling and Deployment-level bookkeeping do not roll pods
    assert template_hash(deployment(spec_of(replicas=5))) == template_hash(a)
    with_ann = deployment(revision_annotations={"rankguard.io/remediation-id": "abc"})
    assert with_ann["metadata"]["annotations"] == {"rankguard.io/remediation-id": "abc"}
    assert "rankguard.io/remediation-id" not in with_ann["spec"]["template"]["metadata"]["annotations"]
    assert template_hash(with_ann) == template_hash(a)
    # the hash annotation itself is not hashed
    tampered = copy.deepcopy(a)
    tampered["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = "0" * 16
    assert template_hash(tampered) == template_hash(a)


@pytest.mark.parametrize(
    "other",
    [
        lambda: deployment(flags=ServingFlags(kv_cache_memory_bytes=KV - 1)),
        lambda: deployment(flags=ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=200 * GiB)),
        lambda: deployment(flags=ServingFlags(gpu_memory_utilization=0.9)),
        lambda: deployment(spec_of(image="vllm/vllm-openai:v0.12.0")),
        lambda: deployment(spec_of(engine={"maxModelLen": 4096})),
        lambda: render_deployment(
            "llama",
            "serving",
            "uid-123",
            spec_of(),
            ServingFlags(kv_cache_memory_bytes=KV),
            agent_image="a:2",
            plan=None,
        ),
    ],
    ids=["kv", "memory-limit", "utilisation", "image", "max-model-len", "agent-image"],
)
def test_hash_changes_with_every_real_change(other: Any) -> None:
    assert template_hash(other()) != template_hash(deployment())


# --- extraArgs ---------------------------------------------------------------------------------


def test_every_flag_rankguard_renders_is_owned() -> None:
    s = spec_of(pipelineParallelSize=2, engine={"maxModelLen": 8192, "enforceEager": True})
    for flags in (ServingFlags(kv_cache_memory_bytes=KV), ServingFlags(gpu_memory_utilization=0.9)):
        rendered = [a for a in vllm_args(s, flags, prior_plan(s)) if a.startswith("--")]
        assert set(rendered) <= set(owned_spellings(rules_for_image(s.image).cli))


def test_the_agent_accepts_the_command_rankguard_renders() -> None:
    """Contract with rankguard_agent's command line: every rendered agent flag parses."""
    from rankguard_agent.__main__ import build_parser

    cmd = deployment(spec_of(agent={"sampleHz": 2.5}))["spec"]["template"]["spec"]["containers"][0]["command"]
    cut = cmd.index("--")
    assert cmd[:3] == ["python3", "/opt/rankguard/agent/rankguard-agent", "launch"] and cmd[cut + 1] == "vllm"
    ns = build_parser().parse_args(cmd[2:cut])
    assert (ns.cmd, ns.port, ns.hz, ns.probe, ns.probe_world_size) == ("launch", 9404, 2.5, True, 4)
    assert (ns.probe_hidden_size, ns.probe_vocab_size, ns.termination_log) == (
        8192,
        128256,
        "/dev/termination-log",
    )
