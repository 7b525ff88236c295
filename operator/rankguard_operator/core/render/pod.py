"""The serving pod: vLLM's container (the agent's launcher around `vllm serve`), its command
lines, env, ports, probes, resources and volumes, and the agent's installer.

One pod per replica (render/deployment wraps it in a Deployment), or, with spec.distributed, one
pod per node of a group (render/group wraps a leader and a worker template in StatefulSets,
render/leader_worker_set in a LeaderWorkerSet). A group's pods differ only where vLLM's
multi-node mode needs them to (`GroupNode`): every pod gets `--nnodes`, `--master-addr` and
`--master-port`, the leader `--node-rank 0`, serves HTTP and carries the probes; a worker runs
`--headless --node-rank $(RANKGUARD_NODE_RANK)`, its node rank read from its pod-index label
through the downward API, with no HTTP probe (a headless vLLM answers none) but a TCP readiness
check on the agent's port (ready once its agent listens). Every pod of a
group asks for its share of the GPUs and tells vLLM its own address (`VLLM_HOST_IP`).

The caller plans once per pass and hands the spec's prior plan in: it sizes the start-up
utilisation rendered next to a byte budget and the agent's probe collectives.

The kubelet expands `$(NAME)` in a container's command, args and env values from the
container's env, and spec.template may add env: a `$(X)` in extraArgs would run vLLM with flags
no check saw and status does not show. So every text rendered from the spec reaches the kubelet
escaped (`$` as `$$`, which the kubelet turns back into `$`): `kube_argv`, the last step of the
vLLM container's command, is the one place, and only rankguard's own references (`KubeRef`: a
group's node rank and leader address) pass through as written. `vllm_args` and everything
built on it (status, `rankguard plan`) keep the user's text; `served_argv` reads a rendered
command back as the process receives it.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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
    NODE_RANK_ENV,
    SHM_MOUNT_PATH,
    SHM_VOLUME,
    TERMINATION_LOG,
    VLLM_CONTAINER,
    VLLM_HTTP_PORT,
)
from rankguard_operator.core.spec.parse import INTERFACE_ENV, ServiceSpec
from rankguard_operator.core.spec.template import CACHE_ENV
from rankguard_operator.core.units import format_quantity

# Downloading and loading a 70B-405B model and capturing CUDA graphs can take many minutes;
# the startup probe must not kill it (spec.engine.startupTimeoutSeconds, 30 min by default), and
# the Deployment's progress deadline must outlast the startup probe plus the agent's own probe
# (300 s by default), or every slow start would be reported as a failed rollout and rolled back.
STARTUP_PROBE_PERIOD_SECONDS = 10


def startup_failures(spec: ServiceSpec) -> int:
    return -(-spec.engine.startup_timeout_seconds // STARTUP_PROBE_PERIOD_SECONDS)  # ceil


class KubeRef(str):
    """Text of rankguard's own that the kubelet is meant to expand (`$(RANKGUARD_NODE_RANK)`,
    `$(LWS_LEADER_ADDRESS)`): `kube_argv` passes it as written. Any other text is escaped."""


def kube_text(text: str) -> str:
    """`text` as the kubelet must receive it to hand `text` itself to the process: every `$`
    doubled (the kubelet turns `$$` into `$`, so no `$(NAME)` in it is expanded). A `KubeRef`
    is passed as written, as a plain str (YAML's safe dumper knows no str subclass)."""
    return str(text) if isinstance(text, KubeRef) else text.replace("$", "$$")


def kube_argv(args: Sequence[str]) -> list[str]:
    """A container's command as rendered into the pod: `kube_text` of every word."""
    return [kube_text(a) for a in args]


def kube_expand(text: str, variables: Mapping[str, str] | None = None) -> str:
    """What the kubelet makes of `text` (a command word or an env value): `$$` is `$`, `$(NAME)`
    is NAME's value in `variables` (left as written when NAME is not there, as the kubelet
    leaves an undefined one), any other `$` is kept. `kube_expand(kube_text(t)) == t`."""
    known = variables or {}
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] != "$" or i + 1 >= n:
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (close := text.find(")", i + 2)) >= 0:
            name = text[i + 2 : close]
            out.append(known.get(name, text[i : close + 1]))
            i = close + 1
        else:
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


@dataclass(frozen=True)
class GroupNode:
    """One pod's place in a multi-node group, as its command line and env say it.

    `master_addr`: the leader's DNS name (a StatefulSet pod's `<pod>.<headless Service>.<ns>`,
    or `$(LWS_LEADER_ADDRESS)`, which LeaderWorkerSet injects). `node_rank_label`: for a worker,
    the pod label that holds its node rank (read through the downward API)."""

    nnodes: int
    role: Literal["leader", "worker"]
    master_addr: str
    master_port: int
    timeout_seconds: int | None = None
    network_interface: str | None = None
    node_rank_label: str | None = None

    @property
    def leader(self) -> bool:
        return self.role == "leader"

    def vllm_flags(self) -> list[str]:
        """vLLM's multi-node flags for this pod (every pod of the group agrees on all but two).
        Rankguard's own text, references included (`KubeRef`): the worker's node rank, and
        LeaderWorkerSet's leader address, are the kubelet's to expand."""
        rank = "0" if self.leader else KubeRef(f"$({NODE_RANK_ENV})")
        flags = ["--nnodes", str(self.nnodes), "--node-rank", rank]
        flags += ["--master-addr", KubeRef(self.master_addr), "--master-port", str(self.master_port)]
        if self.timeout_seconds is not None:
            flags += ["--distributed-timeout-seconds", str(self.timeout_seconds)]
        return flags if self.leader else [*flags, "--headless"]


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
    *,
    node: GroupNode | None = None,
) -> list[str]:
    """Arguments after `vllm`: `serve MODEL` and every flag rankguard owns (on a group's pod,
    its multi-node flags: `node`), then extraArgs.

    The byte budget wins when known: with `--kv-cache-memory-bytes` vLLM sizes the KV cache
    from it alone. A utilisation is still rendered next to it for vLLM's start-up check
    (budget.startup_utilization over the spec's prior `plan`, kept below the free memory
    vLLM measured at start-up, `startup_free_bytes`, and above the weights another process holds
    on the GPU, `external_weight_bytes`), so a small card under TP is not refused at start.

    The user's text as written (status shows these); the pod gets them through `kube_argv`."""
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
    # the OOM levers (core/policy/oom_levers.py): the flag's value when the policy moved it
    seqs = flags.or_spec("max_num_seqs", e.max_num_seqs)
    batched = flags.or_spec("max_num_batched_tokens", e.max_num_batched_tokens)
    eager = flags.or_spec("enforce_eager", e.enforce_eager)
    args += ["--max-num-seqs", str(seqs)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    args += ["--max-num-batched-tokens", str(batched)]
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
    if eager:
        args.append("--enforce-eager")
    elif flags.max_cudagraph_capture_size is not None and e.capture_sizes_flag is None:
        # an eager engine captures nothing; next to the user's own capture sizes vLLM 0.33 refuses
        # a different maximum (config/vllm.py), so those are left as the user set them
        args += ["--max-cudagraph-capture-size", str(flags.max_cudagraph_capture_size)]
    if spec.model.quantization is not None:
        args += ["--quantization", spec.model.quantization]
    args += ["--host", spec.listen_address, "--port", str(VLLM_HTTP_PORT)]
    if node is not None:
        args += node.vllm_flags()
    return args + list(e.extra_args)


def served_argv(pod_spec: Mapping[str, Any], variables: Mapping[str, str] | None = None) -> list[str]:
    """The `vllm` arguments a rendered (or running) pod spec's vLLM container runs: everything
    after the launcher's `-- vllm`, starting with `serve`, as the process receives them (the
    kubelet's expansion undone by `kube_expand`: `$$` is `$`; the `$(NAME)` references of
    `variables` replaced, any other left as written). Raises ValueError when the container
    does not start vLLM through the launcher."""
    [container] = [c for c in pod_spec["containers"] if c["name"] == VLLM_CONTAINER]
    command = [kube_expand(str(word), variables) for word in container["command"]]
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
        # the probe's collectives run over this pod's own GPUs (a group's pod holds its share)
        args += ["--probe", "--probe-world-size", str(spec.gpus_per_pod)]
        s = plan.inputs.shape if plan is not None else shape
        if s is not None:
            # the warm-up collectives are sized like the model's (DESIGN §2 step 3a)
            args += ["--probe-hidden-size", str(s.hidden_size), "--probe-vocab-size", str(s.vocab_size)]
    return args


def _resources(spec: ServiceSpec, flags: ServingFlags) -> dict[str, Any]:
    r = spec.resources
    gpus = str(spec.gpus_per_pod)
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


def _field_ref(path: str) -> dict[str, Any]:
    return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}


def _group_env(node: GroupNode | None) -> list[dict[str, Any]]:
    if node is None:
        return []
    rank: dict[str, Any] = (
        {"name": NODE_RANK_ENV, "value": "0"}
        if node.node_rank_label is None
        else {"name": NODE_RANK_ENV, "valueFrom": _field_ref(f"metadata.labels['{node.node_rank_label}']")}
    )
    # vLLM binds its rendezvous and data-plane sockets to VLLM_HOST_IP; the pod IP is the one
    # address the other pods reach it on
    env = [{"name": "VLLM_HOST_IP", "valueFrom": _field_ref("status.podIP")}, rank]
    if node.network_interface is not None:
        # the spec's text: the kubelet expands env values too
        env += [{"name": n, "value": kube_text(node.network_interface)} for n in INTERFACE_ENV]
    return env


def _env(name: str, spec: ServiceSpec, node: GroupNode | None) -> list[dict[str, Any]]:
    field_ref = _field_ref
    # the spec's text: the kubelet expands env values too (a mount path it does not)
    cache = (
        []
        if spec.model_cache is None
        else [{"name": CACHE_ENV, "value": kube_text(spec.model_cache.mount_path)}]
    )
    return [
        # NVML enumerates in PCI bus order, CUDA "fastest first" by default: make them agree,
        # so rank i's figures are read from the GPU rank i actually uses.
        {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
        {"name": "POD_IP", "valueFrom": field_ref("status.podIP")},
        {"name": "POD_NAME", "valueFrom": field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field_ref("metadata.namespace")},
        {"name": "RANKGUARD_LLMSERVICE", "value": name},
        *_group_env(node),
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


def pod_spec(
    name: str,
    spec: ServiceSpec,
    flags: ServingFlags,
    agent_image: str,
    plan: Plan | None,
    *,
    startup_free_bytes: int | None,
    external_weight_bytes: int | None,
    shape: ModelShape | None,
    node: GroupNode | None = None,
) -> dict[str, Any]:
    """The serving pod's spec, before the user's template is merged (core/spec/template)."""
    serves_http = node is None or node.leader
    vllm: dict[str, Any] = {
        "name": VLLM_CONTAINER,
        "image": spec.image,
        # the last step of the argv: nothing of the spec is expanded by the kubelet
        "command": kube_argv(
            [
                *agent_args(spec, plan, shape),
                "--",
                "vllm",
                *vllm_args(spec, flags, plan, startup_free_bytes, external_weight_bytes, node=node),
            ]
        ),
        "env": _env(name, spec, node),
        "ports": [
            *([{"name": "http", "containerPort": VLLM_HTTP_PORT, "protocol": "TCP"}] if serves_http else []),
            {"name": "agent", "containerPort": spec.agent.port, "protocol": "TCP"},
            *(
                [{"name": "rendezvous", "containerPort": node.master_port, "protocol": "TCP"}]
                if node is not None and node.leader
                else []
            ),
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
        # No livenessProbe: when the engine dies vLLM exits, the launcher exits with it and the
        # kubelet restarts the container; a liveness probe would only kill a busy, healthy engine.
        # Not runAsNonRoot: the upstream vLLM images run as root, and GPU access needs no privilege.
        "securityContext": dict(_RESTRICTED),
    }
    if serves_http:
        vllm["readinessProbe"] = _health_probe(2, 3, 2)
        vllm["startupProbe"] = _health_probe(STARTUP_PROBE_PERIOD_SECONDS, startup_failures(spec), 5)
    else:
        # A headless worker answers no HTTP (the group is ready when its leader is: vLLM's /health
        # answers only once every node joined). It is ready once its agent listens: the agent's
        # own probe runs before its server starts, and a worker counted ready before that would
        # be reported AgentUnavailable at every group start. A TCP check, not /healthz: an agent
        # that cannot start leaves a fallback answering 503 on that port, and that pod must still
        # count, so AgentReady names it.
        vllm["readinessProbe"] = {
            "tcpSocket": {"port": "agent"},
            "periodSeconds": 2,
            "failureThreshold": 3,
            "timeoutSeconds": 2,
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
