"""Renderers: an LLMService spec + the serving flags in effect -> the Deployment and Service.

The output is plain dicts in the API's camelCase, ready for server-side apply with field
manager `rankguard`: only the fields rendered here are owned by rankguard, so a person's
edits to other fields survive. The agent is injected the way the OpenTelemetry operator
injects auto-instrumentation: an init container copies the pure-Python agent into an
emptyDir, and the vLLM container's command becomes
`python3 -m rankguard_agent launch … -- vllm serve MODEL FLAGS…` (DESIGN §2 step 2).

The pod template carries `rankguard.io/template-hash` (a hash of everything else in the
template) so the caller can tell a real change from a re-render of the same thing, and
`rankguard.io/serving-flags` so a terminated pod says which budget it ran with.

Also here: the flags rankguard owns, and the check that refuses extraArgs fighting them.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rankguard_operator.flags import ServingFlags
from rankguard_operator.models import ModelError, ModelShape, resolve_model
from rankguard_operator.units import format_quantity

if TYPE_CHECKING:  # spec.py imports this module for extra_args_conflicts
    from rankguard_operator.spec import ServiceSpec

API_GROUP = "rankguard.io"
OWNER_API_VERSION = "rankguard.io/v1alpha1"
OWNER_KIND = "LLMService"

VLLM_CONTAINER = "vllm"
AGENT_INIT_CONTAINER = "rankguard-agent-install"
AGENT_VOLUME = "rankguard-agent"
AGENT_MOUNT_PATH = "/opt/rankguard/agent"
SHM_VOLUME = "dshm"
TERMINATION_LOG = "/dev/termination-log"
VLLM_HTTP_PORT = 8000
GPU_RESOURCE = "nvidia.com/gpu"

LLMSERVICE_LABEL = "rankguard.io/llmservice"
TEMPLATE_HASH_ANNOTATION = "rankguard.io/template-hash"
FLAGS_ANNOTATION = "rankguard.io/serving-flags"

# Loading a 70B-405B model and capturing CUDA graphs can take many minutes; the startup probe
# must not kill it (30 min here), and the Deployment's progress deadline must outlast the
# startup probe plus the agent's own probe (300 s by default), or every slow start would be
# reported as a failed rollout and rolled back.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_PROBE_FAILURE_THRESHOLD = 180
PROGRESS_DEADLINE_SECONDS = STARTUP_PROBE_PERIOD_SECONDS * STARTUP_PROBE_FAILURE_THRESHOLD + 600

# Kubernetes label values and Service names are at most 63 characters.
_MAX_LABEL = 63

# --------------------------------------------------------------------------------------------
# Flags rankguard owns. Value: the spec field to use instead (None: not user-settable at all).

_OWNED: dict[str, str | None] = {
    "--model": "spec.model.name",
    "--tensor-parallel-size": "spec.tensorParallelSize",
    "-tp": "spec.tensorParallelSize",
    "--pipeline-parallel-size": "spec.pipelineParallelSize",
    "-pp": "spec.pipelineParallelSize",
    "--kv-cache-memory-bytes": "spec.memory.kvCacheMemoryBytes",
    "--gpu-memory-utilization": "spec.memory.gpuMemoryUtilization",
    # A block-count override silently defeats the per-GPU byte budget rankguard manages.
    "--num-gpu-blocks-override": "spec.memory.kvCacheMemoryBytes",
    "--max-num-seqs": "spec.engine.maxNumSeqs",
    "--max-model-len": "spec.engine.maxModelLen",
    "--max-num-batched-tokens": "spec.engine.maxNumBatchedTokens",
    "--block-size": "spec.engine.blockSize",
    "--dtype": "spec.engine.dtype",
    "--kv-cache-dtype": "spec.engine.kvCacheDtype",
    "--enforce-eager": "spec.engine.enforceEager",
    "--no-enforce-eager": "spec.engine.enforceEager",  # vLLM's BooleanOptionalAction spelling
    "--host": None,
    "--port": None,
}
OWNED_FLAGS: tuple[str, ...] = tuple(_OWNED)
_LONG_OWNED = tuple(f for f in OWNED_FLAGS if f.startswith("--"))
_OWNED_BY_NAME = {f.lstrip("-"): f for f in OWNED_FLAGS}


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _canonical(word: str) -> str | None:
    """The owned flag `word` sets, or None. vLLM's parser treats `_` and `-` alike in flag
    names (`--max_model_len`), takes `--flag=value`, and argparse accepts unambiguous prefixes
    of long flags (`--max-model`), so all of those count; so do one-dash long names and
    two-dash short ones (`-dtype`, `--tp`), which the CRD's own rule refuses too."""
    if not word.startswith("-") or _is_number(word):
        return None
    name = word.split("=", 1)[0].lstrip("-").replace("_", "-")
    if not name:
        return None
    if name in _OWNED_BY_NAME:
        return _OWNED_BY_NAME[name]
    if word.startswith("--") and len(name) > 2:
        prefixed = [f for f in _LONG_OWNED if f[2:].startswith(name)]
        if len(prefixed) == 1:
            return prefixed[0]
    return None


def conflicting_flags(extra_args: Sequence[str]) -> list[str]:
    """Owned flags (canonical spelling, first occurrence order) that `extra_args` sets."""
    found: list[str] = []
    for arg in extra_args:
        # People write ["--max-model-len 4096"] as one item; vLLM would choke on it, and it
        # must not slip past this check either, so every word is looked at.
        for word in arg.split():
            flag = _canonical(word)
            if flag is not None and flag not in found:
                found.append(flag)
    return found


def extra_args_conflicts(extra_args: Sequence[str]) -> list[str]:
    """One actionable sentence per owned flag that `extra_args` sets; empty when all is well."""
    messages = []
    for flag in conflicting_flags(extra_args):
        instead = _OWNED[flag]
        if instead is None:
            messages.append(
                f"spec.engine.extraArgs sets {flag}, which rankguard owns (vLLM must listen on "
                f"$(POD_IP):{VLLM_HTTP_PORT} for the Service and the probes); remove it"
            )
        else:
            messages.append(f"spec.engine.extraArgs sets {flag}, which rankguard owns; use {instead} instead")
    return messages


# --------------------------------------------------------------------------------------------
# Names and labels


def _short(name: str) -> str:
    """`name` if it fits a label value / Service name, else a stable truncation with a hash."""
    if len(name) <= _MAX_LABEL:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: _MAX_LABEL - 9].rstrip('-.')}-{digest}"


def labels(name: str) -> dict[str, str]:
    """Labels on the Deployment, its pods and the Service."""
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": _short(name),
        "app.kubernetes.io/managed-by": "rankguard",
        LLMSERVICE_LABEL: _short(name),
    }


def selector(name: str) -> dict[str, str]:
    """The pod selector (immutable on a Deployment, so deliberately small and stable)."""
    return {"app.kubernetes.io/name": "vllm", LLMSERVICE_LABEL: _short(name)}


def owner_reference(name: str, owner_uid: str) -> dict[str, Any]:
    """Makes the LLMService the controller of what it renders, so deleting it cascades."""
    return {
        "apiVersion": OWNER_API_VERSION,
        "kind": OWNER_KIND,
        "name": name,
        "uid": owner_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def service_name(name: str) -> str:
    return _short(name)


# --------------------------------------------------------------------------------------------
# vLLM and agent command lines


def _util_text(u: float) -> str:
    # repr round-trips a float exactly and prints 0.92 as "0.92"
    return repr(float(u))


def vllm_args(spec: ServiceSpec, flags: ServingFlags) -> list[str]:
    """Arguments after `vllm`: `serve MODEL` and every flag rankguard owns, then extraArgs.

    The byte budget wins when known: with `--kv-cache-memory-bytes` vLLM sizes the KV cache
    from it alone. A utilisation is still rendered next to it for vLLM's start-up check
    (see budget.startup_utilization), so a small card under TP is not refused at start."""
    e = spec.engine
    args = ["serve", spec.model.name, "--tensor-parallel-size", str(spec.tp)]
    if spec.pp > 1:
        args += ["--pipeline-parallel-size", str(spec.pp)]
    if flags.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(flags.kv_cache_memory_bytes)]
        # budget imports spec, which imports this module: import at the call.
        from rankguard_operator.budget import startup_utilization  # noqa: PLC0415

        startup = startup_utilization(spec, flags.kv_cache_memory_bytes)
        if startup is not None:
            args += ["--gpu-memory-utilization", _util_text(startup)]
    elif flags.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", _util_text(flags.gpu_memory_utilization)]
    args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    args += [
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--block-size",
        str(e.block_size),
        "--dtype",
        e.dtype,
        "--kv-cache-dtype",
        e.kv_cache_dtype,
    ]
    if e.enforce_eager:
        args.append("--enforce-eager")
    args += ["--host", "$(POD_IP)", "--port", str(VLLM_HTTP_PORT)]
    return args + list(e.extra_args)


def _probe_shape(spec: ServiceSpec, shape: ModelShape | None) -> ModelShape | None:
    if shape is not None:
        return shape
    if spec.model.config_map is not None:
        return None  # only the caller can read the ConfigMap; the agent's defaults apply
    try:
        return resolve_model(spec.model.name, spec.model.shape)
    except ModelError:
        return None


def agent_args(spec: ServiceSpec, shape: ModelShape | None = None) -> list[str]:
    """`python3 -m rankguard_agent launch …` up to (not including) the `--` separator."""
    args = [
        "python3",
        "-m",
        "rankguard_agent",
        "launch",
        "--port",
        str(spec.agent.port),
        "--host",
        "$(POD_IP)",
        "--termination-log",
        TERMINATION_LOG,
        "--hz",
        f"{spec.agent.sample_hz:g}",
    ]
    if spec.agent.probe:
        args += ["--probe", "--probe-world-size", str(spec.world_size)]
        s = _probe_shape(spec, shape)
        if s is not None:
            # the warm-up collectives are sized like the model's (DESIGN §2 step 3a)
            args += ["--probe-hidden-size", str(s.hidden_size), "--probe-vocab-size", str(s.vocab_size)]
    return args


# --------------------------------------------------------------------------------------------
# Deployment and Service


def _resources(spec: ServiceSpec, flags: ServingFlags) -> dict[str, Any]:
    gpus = str(spec.world_size)
    requests: dict[str, str] = {GPU_RESOURCE: gpus}
    limits: dict[str, str] = {GPU_RESOURCE: gpus}
    r = spec.resources
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


def _env(name: str) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    return [
        {"name": "PYTHONPATH", "value": AGENT_MOUNT_PATH},
        # NVML enumerates in PCI bus order, CUDA "fastest first" by default: make them agree,
        # so rank i's figures are read from the GPU rank i actually uses.
        {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
        {"name": "POD_IP", "valueFrom": field_ref("status.podIP")},
        {"name": "POD_NAME", "valueFrom": field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field_ref("metadata.namespace")},
        {"name": "RANKGUARD_LLMSERVICE", "value": name},
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
    name: str, spec: ServiceSpec, flags: ServingFlags, agent_image: str, shape: ModelShape | None
) -> dict[str, Any]:
    vllm = {
        "name": VLLM_CONTAINER,
        "image": spec.image,
        "command": [*agent_args(spec, shape), "--", "vllm", *vllm_args(spec, flags)],
        "env": _env(name),
        "ports": [
            {"name": "http", "containerPort": VLLM_HTTP_PORT, "protocol": "TCP"},
            {"name": "agent", "containerPort": spec.agent.port, "protocol": "TCP"},
        ],
        "resources": _resources(spec, flags),
        "volumeMounts": [
            {"name": AGENT_VOLUME, "mountPath": AGENT_MOUNT_PATH, "readOnly": True},
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
        ],
        # The launcher writes a JSON termination message (rank, bytes requested/free); if it
        # could not, the log tail is the next best evidence.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "readinessProbe": _health_probe(2, 3, 2),
        "startupProbe": _health_probe(STARTUP_PROBE_PERIOD_SECONDS, STARTUP_PROBE_FAILURE_THRESHOLD, 5),
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
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
        ],
    }


def _canonical_json(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def template_hash(deployment: Mapping[str, Any]) -> str:
    """Stable hash (16 hex digits) of a Deployment's pod template, ignoring the hash annotation
    itself: equal for equal renders, different as soon as anything that would roll changes."""
    template = copy.deepcopy(dict(deployment.get("spec", {}).get("template", {})))
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
    revision_annotations: Mapping[str, str] | None = None,
    shape: ModelShape | None = None,
) -> dict[str, Any]:
    """The serving Deployment.

    `revision_annotations` go on the Deployment's own metadata (never the pod template), so
    bookkeeping such as a budget key or remediation id never rolls the pods. `shape` sizes the
    agent's probe collectives; without it the catalog/spec shape is used when known.
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
            "progressDeadlineSeconds": PROGRESS_DEADLINE_SECONDS,
            "template": {
                "metadata": {
                    "labels": dict(pod_labels),
                    "annotations": {FLAGS_ANNOTATION: _canonical_json(flags.to_status())},
                },
                "spec": _pod_spec(name, spec, flags, agent_image, shape),
            },
        },
    }
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
