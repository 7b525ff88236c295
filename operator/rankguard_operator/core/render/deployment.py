"""Renderers: an LLMService spec + the serving flags in effect -> the Deployment and Service.

The output is plain dicts in the API's camelCase, ready for server-side apply with field
manager `rankguard`: only the fields rendered here are owned by rankguard, so a person's
edits to other fields survive. The agent is injected the way the OpenTelemetry operator
injects auto-instrumentation: an init container copies the pure-Python agent into an
emptyDir, and the vLLM container's command becomes
`python3 /opt/rankguard/agent/rankguard-agent launch … -- vllm serve MODEL FLAGS…` (DESIGN §2
step 2). The user's `spec.template` (core/spec/template) is merged last: their env, volumes,
scheduling fields and sidecars around what rankguard owns. The model cache (spec.modelCache)
is a PersistentVolumeClaim mounted at its mountPath with HF_HOME pointing there.

The pod template carries `rankguard.io/template-hash` (a hash of everything else in the
template) so the caller can tell a real change from a re-render of the same thing, and
`rankguard.io/serving-flags` so a terminated pod says which budget it ran with.

The caller plans once per pass and hands the spec's prior plan in: it sizes the start-up
utilisation rendered next to a byte budget and the agent's probe collectives.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.budget.bounds import startup_utilization
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.names import (
    AGENT_ENTRY,
    AGENT_INIT_CONTAINER,
    AGENT_MOUNT_PATH,
    AGENT_VOLUME,
    CACHE_VOLUME,
    FLAGS_ANNOTATION,
    SHM_MOUNT_PATH,
    SHM_VOLUME,
    TEMPLATE_HASH_ANNOTATION,
    TERMINATION_LOG,
    VLLM_CONTAINER,
    VLLM_HTTP_PORT,
    labels,
    owner_reference,
    selector,
    service_name,
)
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.spec.template import CACHE_ENV, apply_template
from rankguard_operator.core.units import format_quantity

# Downloading and loading a 70B-405B model and capturing CUDA graphs can take many minutes;
# the startup probe must not kill it (spec.engine.startupTimeoutSeconds, 30 min by default), and
# the Deployment's progress deadline must outlast the startup probe plus the agent's own probe
# (300 s by default), or every slow start would be reported as a failed rollout and rolled back.
STARTUP_PROBE_PERIOD_SECONDS = 10
PROGRESS_DEADLINE_MARGIN_SECONDS = 600


def _startup_failures(spec: ServiceSpec) -> int:
    return -(-spec.engine.startup_timeout_seconds // STARTUP_PROBE_PERIOD_SECONDS)  # ceil


# --------------------------------------------------------------------------------------------
# vLLM and agent command lines


def _util_text(u: float) -> str:
    # repr round-trips a float exactly and prints 0.92 as "0.92"
    return repr(float(u))


def vllm_args(
    spec: ServiceSpec,
    flags: ServingFlags,
    plan: Plan | None,
    startup_free_bytes: int | None = None,
    external_weight_bytes: int | None = None,
) -> list[str]:
    """Arguments after `vllm`: `serve MODEL` and every flag rankguard owns, then extraArgs.

    The byte budget wins when known: with `--kv-cache-memory-bytes` vLLM sizes the KV cache
    from it alone. A utilisation is still rendered next to it for vLLM's start-up check
    (budget.startup_utilization over the spec's prior `plan`, kept below the free memory
    vLLM measured at start-up, `startup_free_bytes`, and above the weights another process holds
    on the GPU, `external_weight_bytes`), so a small card under TP is not refused at start."""
    e = spec.engine
    args = ["serve", spec.model.name, "--tensor-parallel-size", str(spec.tp)]
    if spec.pp > 1:
        args += ["--pipeline-parallel-size", str(spec.pp)]
    if flags.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(flags.kv_cache_memory_bytes)]
        startup = startup_utilization(
            plan, flags.kv_cache_memory_bytes, startup_free_bytes, external_weight_bytes
        )
        if startup is not None:
            args += ["--gpu-memory-utilization", _util_text(startup)]
    elif flags.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", _util_text(flags.gpu_memory_utilization)]
    args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    if e.block_size is not None:
        # only when asked: vLLM picks the block size per attention backend otherwise, and a
        # forced size can conflict with the backend (8 with FlashAttention)
        args += ["--block-size", str(e.block_size)]
    args += [
        "--dtype",
        e.dtype,
        "--kv-cache-dtype",
        e.kv_cache_dtype,
    ]
    if e.enforce_eager:
        args.append("--enforce-eager")
    if spec.model.quantization is not None:
        args += ["--quantization", spec.model.quantization]
    args += ["--host", spec.listen_address, "--port", str(VLLM_HTTP_PORT)]
    return args + list(e.extra_args)


def served_argv(pod_spec: Mapping[str, Any]) -> list[str]:
    """The `vllm` arguments a rendered (or running) pod spec's vLLM container runs: everything
    after the launcher's `-- vllm`, starting with `serve`. Raises ValueError when the container
    does not start vLLM through the launcher."""
    [container] = [c for c in pod_spec["containers"] if c["name"] == VLLM_CONTAINER]
    command = list(container["command"])
    at = command.index("--")
    if command[at + 1 : at + 2] != ["vllm"]:
        raise ValueError(f"the launcher does not start vllm: {command}")
    return command[at + 2 :]


def agent_args(spec: ServiceSpec, plan: Plan | None, shape: ModelShape | None = None) -> list[str]:
    """`python3 /opt/rankguard/agent/rankguard-agent launch …` up to (not including) the `--`
    separator. Run by path: Python puts the bundle first on the agent's own sys.path, so no
    PYTHONPATH is set and vLLM keeps the image's own packages (pynvml above all). The probe's
    collectives are sized like the model: the plan's shape, or before there is a plan the shape
    the spec alone names (`shape`, ModelResolution.spec_shape); none, and the agent's defaults
    apply."""
    args = [
        "python3",
        AGENT_ENTRY,
        "launch",
        "--port",
        str(spec.agent.port),
        "--host",
        spec.listen_address,
        "--termination-log",
        TERMINATION_LOG,
        "--hz",
        f"{spec.agent.sample_hz:g}",
    ]
    if spec.agent.probe:
        args += ["--probe", "--probe-world-size", str(spec.world_size)]
        s = plan.inputs.shape if plan is not None else shape
        if s is not None:
            # the warm-up collectives are sized like the model's (DESIGN §2 step 3a)
            args += ["--probe-hidden-size", str(s.hidden_size), "--probe-vocab-size", str(s.vocab_size)]
    return args


# --------------------------------------------------------------------------------------------
# Deployment and Service


def _resources(spec: ServiceSpec, flags: ServingFlags) -> dict[str, Any]:
    r = spec.resources
    gpus = str(spec.world_size)
    requests: dict[str, str] = {r.gpu_resource_name: gpus}
    limits: dict[str, str] = {r.gpu_resource_name: gpus}
    if r.cpu_request is not None:
        requests["cpu"] = r.cpu_request
    if r.cpu_limit is not None:
        limits["cpu"] = r.cpu_limit
    mem_limit = flags.memory_limit_bytes if flags.memory_limit_bytes is not None else r.memory_limit_bytes
    mem_request = r.memory_request_bytes
    if mem_request is not None and mem_limit is not None and mem_request > mem_limit:
        # Kubernetes refuses request > limit; a limit set by remediation only ever rises, but a
        # hand-edited status could say otherwise, and the pod must still be valid.
        mem_request = mem_limit
    if mem_request is not None:
        requests["memory"] = format_quantity(mem_request)
    if mem_limit is not None:
        limits["memory"] = format_quantity(mem_limit)
    return {"requests": requests, "limits": limits}


def _env(name: str, spec: ServiceSpec) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    cache = [] if spec.model_cache is None else [{"name": CACHE_ENV, "value": spec.model_cache.mount_path}]
    return [
        # NVML enumerates in PCI bus order, CUDA "fastest first" by default: make them agree,
        # so rank i's figures are read from the GPU rank i actually uses.
        {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
        {"name": "POD_IP", "valueFrom": field_ref("status.podIP")},
        {"name": "POD_NAME", "valueFrom": field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field_ref("metadata.namespace")},
        {"name": "RANKGUARD_LLMSERVICE", "value": name},
        *cache,
    ]


def _health_probe(period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


_RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_spec(
    name: str,
    spec: ServiceSpec,
    flags: ServingFlags,
    agent_image: str,
    plan: Plan | None,
    *,
    startup_free_bytes: int | None,
    external_weight_bytes: int | None,
    shape: ModelShape | None,
) -> dict[str, Any]:
    vllm = {
        "name": VLLM_CONTAINER,
        "image": spec.image,
        "command": [
            *agent_args(spec, plan, shape),
            "--",
            "vllm",
            *vllm_args(spec, flags, plan, startup_free_bytes, external_weight_bytes),
        ],
        "env": _env(name, spec),
        "ports": [
            {"name": "http", "containerPort": VLLM_HTTP_PORT, "protocol": "TCP"},
            {"name": "agent", "containerPort": spec.agent.port, "protocol": "TCP"},
        ],
        "resources": _resources(spec, flags),
        "volumeMounts": [
            {"name": AGENT_VOLUME, "mountPath": AGENT_MOUNT_PATH, "readOnly": True},
            {"name": SHM_VOLUME, "mountPath": SHM_MOUNT_PATH},
            *_cache_mounts(spec),
        ],
        # The launcher writes a JSON termination message (rank, bytes requested/free); if it
        # could not, the log tail is the next best evidence.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": _health_probe(2, 3, 2),
        "startupProbe": _health_probe(STARTUP_PROBE_PERIOD_SECONDS, _startup_failures(spec), 5),
        # No livenessProbe: when the engine dies vLLM exits, the launcher exits with it and the
        # kubelet restarts the container; a liveness probe would only kill a busy, healthy engine.
        # Not runAsNonRoot: the upstream vLLM images run as root, and GPU access needs no privilege.
        "securityContext": dict(_RESTRICTED),
    }
    init = {
        "name": AGENT_INIT_CONTAINER,
        "image": spec.agent.image or agent_image,
        "command": ["rankguard-agent-install", AGENT_MOUNT_PATH],
        "volumeMounts": [{"name": AGENT_VOLUME, "mountPath": AGENT_MOUNT_PATH}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {**_RESTRICTED, "readOnlyRootFilesystem": True},
    }
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shared_memory_bytes is not None:
        shm["sizeLimit"] = format_quantity(spec.resources.shared_memory_bytes)
    return {
        "automountServiceAccountToken": False,
        # A Service named "vllm" in the namespace would inject VLLM_PORT=tcp://…, which vLLM
        # reads as its own setting and fails on; service links serve no purpose here.
        "enableServiceLinks": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [init],
        "containers": [vllm],
        "volumes": [
            {"name": AGENT_VOLUME, "emptyDir": {}},
            # NCCL and vLLM's worker message queues use /dev/shm; the runtime default is 64 MiB.
            # Memory-backed, so it counts toward the container memory limit.
            {"name": SHM_VOLUME, "emptyDir": shm},
            *_cache_volumes(name, spec),
        ],
    }


def _cache_mounts(spec: ServiceSpec) -> list[dict[str, Any]]:
    if spec.model_cache is None:
        return []
    return [{"name": CACHE_VOLUME, "mountPath": spec.model_cache.mount_path}]


def _cache_volumes(name: str, spec: ServiceSpec) -> list[dict[str, Any]]:
    if spec.model_cache is None:
        return []
    return [{"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": spec.model_cache.claim(name)}}]


def _canonical_json(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def template_hash(deployment: Mapping[str, Any]) -> str:
    """Stable hash (16 hex digits) of a Deployment's pod template, ignoring the hash annotation
    itself: equal for equal renders, different as soon as anything that would roll changes."""
    # a shallow copy is enough: only `metadata` is replaced, never changed in place
    template = dict(deployment.get("spec", {}).get("template", {}))
    meta = template.get("metadata") or {}
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(TEMPLATE_HASH_ANNOTATION, None)
    if meta:
        template["metadata"] = {**meta, "annotations": annotations}
    return hashlib.sha256(_canonical_json(template).encode()).hexdigest()[:16]


def render_deployment(
    name: str,
    namespace: str,
    owner_uid: str,
    spec: ServiceSpec,
    flags: ServingFlags,
    *,
    agent_image: str,
    plan: Plan | None,
    revision_annotations: Mapping[str, str] | None = None,
    startup_free_bytes: int | None = None,
    external_weight_bytes: int | None = None,
    shape: ModelShape | None = None,
) -> dict[str, Any]:
    """The serving Deployment.

    `plan` is the spec's prior plan (budget.prior_plan; None when the GPU size is not known
    yet): it sizes the start-up utilisation and the agent's probe collectives.
    `startup_free_bytes`: the least free memory vLLM measured at a worker's start-up (kept in
    status), which that utilisation must stay under; `external_weight_bytes`: the weights another
    process holds on one GPU (kept in status after vLLM refused for them), which it must exceed.
    `shape`: the model's shape as the spec alone names it, which sizes the agent's probe while
    there is no plan (see `agent_args`).
    `revision_annotations` go on the Deployment's own metadata (never the pod template), so
    bookkeeping such as a remediation id never rolls the pods.
    """
    pod_labels = labels(name)
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(pod_labels),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            # maxSurge 0: a surge pod would need another tp×pp free GPUs, which a GPU cluster
            # rarely has, so it would sit Pending and the roll would never progress. Replace in
            # place, one pod at a time, instead.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 10,
            "progressDeadlineSeconds": STARTUP_PROBE_PERIOD_SECONDS * _startup_failures(spec)
            + PROGRESS_DEADLINE_MARGIN_SECONDS,
            "template": {
                "metadata": {
                    "labels": dict(pod_labels),
                    "annotations": {FLAGS_ANNOTATION: _canonical_json(flags.to_status())},
                },
                "spec": _pod_spec(
                    name,
                    spec,
                    flags,
                    agent_image,
                    plan,
                    startup_free_bytes=startup_free_bytes,
                    external_weight_bytes=external_weight_bytes,
                    shape=shape,
                ),
            },
        },
    }
    template = deployment["spec"]["template"]
    apply_template(spec.template, template["metadata"], template["spec"])
    if revision_annotations:
        deployment["metadata"]["annotations"] = dict(revision_annotations)
    deployment["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = template_hash(
        deployment
    )
    return deployment


def render_service(name: str, namespace: str, owner_uid: str, spec: ServiceSpec) -> dict[str, Any]:
    """ClusterIP Service for vLLM's OpenAI API (port 8000) and the agent's endpoints."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(name),
            "namespace": namespace,
            "labels": labels(name),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": [
                {"name": "http", "port": VLLM_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "agent", "port": spec.agent.port, "targetPort": "agent", "protocol": "TCP"},
            ],
        },
    }
