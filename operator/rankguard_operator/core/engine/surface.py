"""vLLM's options that change what rankguard plans, and what rankguard does with each.

Three things about a pod must hold for the budget to mean anything: the GPUs it asks for are
the GPUs vLLM uses (its world size), vLLM answers plain HTTP on the port the Service, the probes
and the agent use, and the memory vLLM uses is the memory the planner counted. The snapshot
records which options touch each (surface.json: the world size's factors, the options the
serve command and the socket set-up read, the options that size memory); every one of them is
here, or owned (core/engine/owned_flags), or in `NO_EFFECT` with the reason it changes none of
the three. tests/unit/core/engine/test_surface.py fails when a new vLLM adds one that is nowhere.

- `REFUSED`: the option turns on something a rankguard pod cannot be (no HTTP server, a world
  larger than the pod, TLS the probes cannot speak, another launcher): refused with the reason.
- `MEASURE_FIRST`: the option changes GPU memory in a way the planner does not model: the
  service is measured, not planned (the ModelResolved condition says why).
- `HOST_MEMORY`: options that take host RAM, held against the pod's memory limit.
- Rules vLLM checks before it loads anything (`RULES`: one option needs another, a value out
  of range), so a spec that would crash-loop is refused at apply time.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rankguard_operator.core.engine.config_checks import config_problems
from rankguard_operator.core.engine.settings import Setting, float_value, int_value, settings, turned_on
from rankguard_operator.core.engine.vllm_cli import HELP, VllmCli
from rankguard_operator.core.units import GiB, format_bytes
from rankguard_operator.vllm_snapshots import version_key

_NO_HTTP = "nothing would answer HTTP on the port the Service, the probes and the agent use"
_DP = (
    "one pod is one data-parallel replica of tensor × pipeline GPUs; run more replicas with "
    "spec.replicas (the Service balances them)"
)
_MULTI_NODE = (
    "rankguard renders vLLM's multi-node flags on every pod of a group itself: set "
    "spec.distributed.podsPerGroup to serve the model across pods"
)
_TLS = (
    "TLS at vLLM is not supported: the probes, the Service and the agent speak plain HTTP to it; "
    "terminate TLS at an Ingress, a Gateway or a service mesh"
)
_RAY = (
    "a Ray executor places ranks on pods of its own choosing, so which pod holds which rank (and "
    "which rank ran out of memory) cannot be computed; rankguard runs vLLM's mp executor, across "
    "pods with spec.distributed"
)

_ARCH_ONLY = (
    "{what} is implemented for a few architectures only (vLLM refuses it for the others, e.g. "
    "Llama and Qwen3-MoE, when it builds its config) and the planner does not model its memory"
)

# dest -> why a rankguard pod cannot run with it turned on
REFUSED: dict[str, str] = {
    HELP: "prints the help and exits: the container would restart forever",
    "headless": f"starts no API server: {_NO_HTTP} (spec.distributed runs a group's other pods headless)",
    "grpc": f"serves gRPC instead of HTTP: {_NO_HTTP}",
    "grpc_port": f"belongs to the gRPC front end: {_NO_HTTP}",
    "uds": f"listens on a unix socket instead of the port: {_NO_HTTP}",
    "ssl_keyfile": _TLS,
    "ssl_certfile": _TLS,
    "ssl_ca_certs": _TLS,
    "ssl_cert_reqs": _TLS,
    "ssl_ciphers": _TLS,
    "enable_ssl_refresh": _TLS,
    "prefill_context_parallel_size": (
        "multiplies vLLM's world size (tensor × pipeline × prefill-context parallel) past the "
        "tensor × pipeline GPUs the pod asks for, and the planner does not model it"
    ),
    "data_parallel_size_local": _DP,
    "data_parallel_rank": _DP,
    "data_parallel_start_rank": _DP,
    "data_parallel_address": _DP,
    "data_parallel_rpc_port": _DP,
    "data_parallel_backend": _DP,
    "data_parallel_hybrid_lb": _DP,
    "data_parallel_external_lb": _DP,
    "data_parallel_multi_port_external_lb": _DP,
    "data_parallel_supervisor_port": _DP,
    "enable_elastic_ep": "elastic expert parallelism grows and shrinks the world at run time; " + _DP,
    "elastic_ep_max_dp_size": "elastic expert parallelism grows and shrinks the world at run time; " + _DP,
    "enable_eplb": (
        "expert-parallel load balancing moves experts between GPUs while serving and adds redundant "
        "experts' weights the planner does not count"
    ),
    "nnodes": _MULTI_NODE,
    "node_rank": _MULTI_NODE,
    "master_addr": _MULTI_NODE,
    "master_port": _MULTI_NODE,
    "ray_workers_use_nsight": _RAY,
    # vLLM 0.34
    "headless_client_handshake_address": (
        "hands headless engines to another front end (vLLM's Rust front end passes it with --headless, "
        f"which is refused): {_NO_HTTP}"
    ),
    "checkpoint_prepare_on_startup": (
        "prepares a process checkpoint as the engine starts, which then serves nothing until "
        "something calls /checkpoint/restore: the pod would never become ready"
    ),
    # Features vLLM builds only for the few architectures that implement them (its model registry
    # decides, in the pod): the extraArgs table's refusals stay refused over both the dense and
    # the mixture-of-experts catalog model it builds over, and the planner models none of them
    "enable_hc_sp": _ARCH_ONLY.format(what="hybrid-context sequence parallelism"),
    "use_replayssm": _ARCH_ONLY.format(what="the replayed SSM state cache"),
    "engram_config": _ARCH_ONLY.format(what="Engram n-gram embeddings"),
}

# dest -> what the planner does not model about it (the service is measured instead)
MEASURE_FIRST: dict[str, str] = {
    "speculative_config": "speculative decoding (a draft model or MTP layers) is not modelled",
    "enable_lora": "LoRA adapters are not modelled",
    "kv_transfer_config": "a KV connector (e.g. LMCache) holds GPU memory that is not modelled",
    "kv_offloading_size": "KV offloading's GPU staging buffers are not modelled",
    "cpu_offload_gb": "weights offloaded to host memory (--cpu-offload-gb) are not modelled",
    "cpu_offload_params": "weights offloaded to host memory are not modelled",
    "offload_backend": "weights offloaded to host memory are not modelled",
    "offload_group_size": "weights offloaded to host memory are not modelled",
    "offload_num_in_group": "weights offloaded to host memory are not modelled",
    "offload_params": "weights offloaded to host memory are not modelled",
    "offload_prefetch_step": "weights offloaded to host memory are not modelled",
    "mm_ipc_gpu_memory_gb": "the multimodal IPC buffer on the GPU is not modelled",
    "enable_expert_parallel": (
        "expert parallelism places whole experts on each GPU instead of a slice of every expert; "
        "the per-rank weights are not modelled"
    ),
    "decode_context_parallel_size": (
        "decode context parallelism splits each request's KV cache across ranks; the KV model does "
        "not count it"
    ),
    # what the model is, as the planner reads it from config.json, changed on the command line
    "quantization_config": "online quantisation (--quantization-config) changes the weights' size per layer",
    "hf_overrides": "--hf-overrides changes the model's config.json as vLLM reads it",
    "hf_config_path": "--hf-config-path points vLLM at another config.json than the model's",
    "kv_cache_dtype_skip_layers": "layers that keep a 16-bit KV cache under a quantised one are not modelled",
    "disable_sliding_window": "sliding-window layers that keep the whole context are not modelled",
    "mamba_cache_dtype": "another dtype for the Mamba state cache is not modelled",
    "mamba_ssm_cache_dtype": "another dtype for the Mamba state cache is not modelled",
    # what the KV cache holds, fixed on the command line (it also keeps vLLM 0.34 from measuring
    # its KV cache after warm-up: the sizing mode is pinned, core/engine/sizing_mode.py)
    "num_gpu_blocks_override": (
        "--num-gpu-blocks-override fixes the KV cache's block count, whatever the budget"
    ),
}

# dest -> host memory in bytes for one value (and whether the figure is per GPU)
HOST_MEMORY: dict[str, tuple[str, bool]] = {
    "cpu_offload_gb": ("GiB of weights per GPU", True),
    "kv_offloading_size": ("GiB of KV cache in host memory, all ranks together", False),
    "mm_processor_cache_gb": ("GiB of multimodal processor cache", False),
}

# Options the snapshot lists as deciding the endpoint or sizing memory that change none of the
# three things above (or are owned elsewhere): dest -> why not.
NO_EFFECT: dict[str, str] = {
    "api_server_count": "more API server processes share the same port (0 is refused: see RULES)",
    "model": "owned: spec.model.name",
    "host": "owned: the pod's listen address",
    "port": "owned: the pod's port",
    "uvicorn_log_level": "logging only",
    "disable_uvicorn_access_log": "logging only",
    "h11_max_header_count": "HTTP parsing limits only",
    "h11_max_incomplete_event_size": "HTTP parsing limits only",
    "kv_offloading_backend": "chooses the KV offloading implementation; its size is what counts",
    "sleep_mode_offload_cudagraph": "only while the engine sleeps, when it serves nothing",
    "data_parallel_size": "owned: spec.replicas",
    "gpu_memory_utilization": "owned: spec.memory.gpuMemoryUtilization",
    "kv_cache_memory_bytes": "owned: spec.memory.kvCacheMemoryBytes",
    "pipeline_parallel_size": "owned: spec.pipelineParallelSize",
    "tensor_parallel_size": "owned: spec.tensorParallelSize",
}

# Options a vLLM release added that change none of the three things above: dest -> why they are
# accepted as they are. With REFUSED, MEASURE_FIRST, HOST_MEMORY, NO_EFFECT and the owned flags,
# every option a newer release adds is ruled on (tests/unit/core/engine/test_surface.py).
ACCEPTED: dict[str, str] = {
    # vLLM 0.34
    "cache_aware_admission_window": "the order waiting requests are admitted in, within the same KV cache",
    "cache_aware_admission_threshold": "the order waiting requests are admitted in, within the same KV cache",
    "max_num_inflight_kv_loads": (
        "caps the requests holding KV blocks for an async KV connector's loads, inside the KV cache "
        "vLLM sized (the connector itself is --kv-transfer-config, measured first)"
    ),
    "shuffle_safetensors_files": (
        "the order each rank reads the checkpoint's files in; the weights are the same"
    ),
}

# The executors a pod can run: vLLM's default multiprocessing one, or none for one GPU.
EXECUTORS = ("mp", "uni")


def _rules(found: Mapping[str, Setting], tp: int, pp: int, version: str) -> list[str]:
    """What vLLM checks before it loads anything (its serve-args validation and ParallelConfig)."""
    problems = [
        _api_server_count_problem(found),
        _prefill_context_problem(found),
        _decode_context_problem(found, tp),
        _executor_problem(found, tp * pp),
        *_companion_problems(found, version),
        _per_request_metrics_problem(found),
        _keep_alive_problem(found),
    ]
    return [p for p in problems if p is not None]


def _api_server_count_problem(found: Mapping[str, Setting]) -> str | None:
    s = found.get("api_server_count")
    if s is not None and (int_value(s.value) or 0) < 1:
        return f"[{s.at}] {s.key} {s.value} starts no API server: {_NO_HTTP}"
    return None


def _prefill_context_problem(found: Mapping[str, Setting]) -> str | None:
    # (refused here, not with the rest of REFUSED: 1 is vLLM's default and changes nothing)
    s = found.get("prefill_context_parallel_size")
    if s is None or not turned_on(s):
        return None
    if (int_value(s.value) or 0) < 1:
        return f"[{s.at}] {s.key} {s.value} leaves vLLM a world of no GPUs; leave it out (1)"
    return f"[{s.at}] {s.key} {s.value} {REFUSED['prefill_context_parallel_size']}"


def _decode_context_problem(found: Mapping[str, Setting], tp: int) -> str | None:
    s = found.get("decode_context_parallel_size")
    dcp = int_value(s.value) if s is not None else None
    if s is not None and dcp is not None and (dcp < 1 or tp % dcp):
        return (
            f"[{s.at}] {s.key} {s.value} must divide spec.tensorParallelSize ({tp}): vLLM's decode context "
            "parallel groups are made of tensor-parallel ranks"
        )
    return None


# --distributed-executor-backend values that cannot run in a rankguard pod -> why
_EXECUTORS_REFUSED = {
    "ray": f"ray is refused: {_RAY}",
    "external_launcher": (
        "external_launcher is refused: every rank would have to be started by a launcher such as "
        "torchrun, and the pod starts vLLM once"
    ),
}


def _executor_problem(found: Mapping[str, Setting], gpus: int) -> str | None:
    s = found.get("distributed_executor_backend")
    if s is None or s.value is None or s.value in ("", "None"):
        return None
    if s.value in _EXECUTORS_REFUSED:
        return f"[{s.at}] {s.key} {_EXECUTORS_REFUSED[s.value]}"
    if s.value not in EXECUTORS:
        return f"[{s.at}] {s.key} must be one of {', '.join(EXECUTORS)}; got {s.value!r}"
    if s.value == "uni" and gpus > 1:
        return f"[{s.at}] {s.key} uni runs one process and cannot drive {gpus} GPUs; use mp or leave it out"
    return None


# dest -> the option vLLM refuses to start without when it is turned on
_NEEDS = (
    ("enable_auto_tool_choice", "tool_call_parser"),
    ("enable_log_outputs", "enable_log_requests"),
    ("collect_detailed_traces", "otlp_traces_endpoint"),
    ("per_request_spec_decode_metrics", "speculative_config"),
    ("numa_bind_nodes", "numa_bind"),
    ("numa_bind_cpus", "numa_bind"),
)


# From vLLM 0.34 on (config/parallel.py ParallelConfig.__post_init__) a NUMA binding list turns
# numa_bind on by itself; only an explicit --no-numa-bind beside one is refused.
_NUMA_LISTS_TURN_BIND_ON = (0, 34, 0)


def _companion_problems(found: Mapping[str, Setting], version: str) -> list[str]:
    problems = []
    lists_bind = (version_key(version) or (0, 0, 0)) >= _NUMA_LISTS_TURN_BIND_ON
    for dest, needs in _NEEDS:
        s = found.get(dest)
        need = found.get(needs)
        if s is None or not turned_on(s):
            continue
        if lists_bind and needs == "numa_bind":
            if need is not None and not turned_on(need):
                problems.append(f"[{s.at}] {s.key} cannot be combined with {need.key} (vLLM refuses both)")
            continue
        if need is None or not turned_on(need):
            flag = "--" + needs.replace("_", "-")
            problems.append(f"[{s.at}] {s.key} needs {flag} (vLLM refuses to start without it)")
    return problems


def _per_request_metrics_problem(found: Mapping[str, Setting]) -> str | None:
    s = found.get("enable_per_request_metrics")
    off = found.get("disable_log_stats")
    if s is not None and turned_on(s) and off is not None and off.on:
        return f"[{s.at}] {s.key} needs engine statistics: remove {off.key} (vLLM refuses both)"
    return None


def _keep_alive_problem(found: Mapping[str, Setting]) -> str | None:
    s = found.get("sse_keep_alive_interval")
    if s is not None and (int_value(s.value) or 0) < 0:
        return f"[{s.at}] {s.key} must be 0 (off) or a positive number of seconds"
    return None


def check_surface(extra_args: Sequence[str], cli: VllmCli, tp: int, pp: int) -> list[str]:
    """One sentence per extraArgs item a rankguard pod cannot run with (beyond the reader's own
    problems and the owned flags, core/engine/owned_flags), each naming the item."""
    words, _ = cli.walk(extra_args)
    found = settings(words)
    problems = [
        f"[{s.at}] {s.key} is refused: {REFUSED[dest]}"
        for dest, s in found.items()
        if dest in REFUSED and dest != "prefill_context_parallel_size" and _refuses(dest, s)
    ]
    problems += _rules(found, tp, pp, cli.version)
    s = found.get("enable_fault_tolerance")
    if s is not None and turned_on(s):
        problems.append(
            f"[{s.at}] {s.key} needs vLLM's external data-parallel load balancing "
            f"(--data-parallel-external-lb or --data-parallel-rank), which a rankguard pod cannot have: {_DP}"
        )
    problems += config_problems(extra_args, cli, found)
    return [f"spec.engine.extraArgs{p}" for p in sorted(problems, key=_position)]


def _refuses(dest: str, s: Setting) -> bool:
    # any value other than vLLM's default: `--nnodes 0` and `--node-rank=-1` are no more a
    # single pod than `--nnodes 2` (vLLM bounds the rank from above only)
    return dest == HELP or turned_on(s)


def _position(problem: str) -> int:
    return int(problem[1 : problem.index("]")])


def measure_first_reasons(extra_args: Sequence[str], cli: VllmCli) -> list[str]:
    """What the extraArgs turn on that the planner does not model, in order, once each."""
    words, _ = cli.walk(extra_args)
    found = settings(words)
    reasons = []
    for dest, s in sorted(found.items(), key=lambda kv: kv[1].at):
        if dest in MEASURE_FIRST and turned_on(s):
            if dest == "decode_context_parallel_size" and (int_value(s.value) or 1) <= 1:
                continue
            reasons.append(MEASURE_FIRST[dest])
    return list(dict.fromkeys(reasons))


def host_memory_bytes(extra_args: Sequence[str], cli: VllmCli, gpus: int) -> tuple[int, list[str]]:
    """The host memory the extraArgs ask vLLM to hold, and the items that ask for it."""
    words, _ = cli.walk(extra_args)
    found = settings(words)
    total = 0
    parts = []
    for dest, (what, per_gpu) in HOST_MEMORY.items():
        s = found.get(dest)
        gib = float_value(s.value) if s is not None else None
        if s is None or gib is None or gib <= 0:
            continue
        nbytes = int(gib * GiB) * (gpus if per_gpu else 1)
        total += nbytes
        parts.append(f"{s.key} {s.value} ({what}: {format_bytes(nbytes)})")
    offload = found.get("kv_offloading_size")
    if offload is None or not turned_on(offload):  # else vLLM writes that size over the connector's
        kv = _connector_host_bytes(cli.json_object(extra_args, "kv_transfer_config"))
        if kv and "kv_transfer_config" in found:
            total += kv
            s = found["kv_transfer_config"]
            parts.append(f"{s.key} cpu_bytes_to_use (KV cache in host memory: {format_bytes(kv)})")
    return total, parts


def _connector_host_bytes(doc: Mapping[str, object] | None) -> int:
    """The pinned host memory a KV connector's extra config asks for: the offloading connectors'
    `cpu_bytes_to_use` (what `--kv-offloading-size` becomes in vLLM's config), a MultiConnector's
    children's together."""
    if not isinstance(doc, Mapping):
        return 0
    extra = doc.get("kv_connector_extra_config")
    if not isinstance(extra, Mapping):
        return 0
    size = extra.get("cpu_bytes_to_use")
    total = int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0 else 0
    children = extra.get("connectors")
    for child in children if isinstance(children, list) else []:
        total += _connector_host_bytes(child if isinstance(child, Mapping) else None)
    return total


def check_host_memory(
    extra_args: Sequence[str], cli: VllmCli, gpus: int, memory_limit_bytes: int | None
) -> list[str]:
    """Refuse extraArgs that ask for more host memory than the pod's limit allows."""
    total, parts = host_memory_bytes(extra_args, cli, gpus)
    if memory_limit_bytes is None or total <= memory_limit_bytes:
        return []
    return [
        f"spec.engine.extraArgs ask vLLM to hold {format_bytes(total)} of host memory ({'; '.join(parts)}), "
        "more than the pod's memory limit spec.resources.limits.memory "
        f"({format_bytes(memory_limit_bytes)}): "
        "the container would be OOMKilled; raise the limit or lower the sizes"
    ]


def block_size_problem(
    surface: Mapping[str, object], block_size: int, version: str, allowed: Sequence[int] = ()
) -> str | None:
    """Why vLLM cannot start with `--block-size N` on a CUDA GPU (None: some attention backend
    it picks from takes N). The snapshot records, for each backend of vLLM's CUDA priority
    list, the block sizes its own `supports_block_size` accepts; the message offers those of
    them in `allowed` (the CRD's enum) when given."""
    backends = surface.get("attention_block_sizes")
    if not isinstance(backends, Mapping) or not backends:
        return None
    if any(block_size in sizes for sizes in backends.values() if isinstance(sizes, list)):
        return None
    usable = sorted({s for sizes in backends.values() if isinstance(sizes, list) for s in sizes})
    usable = [s for s in usable if s in allowed] if allowed else usable
    return (
        f"spec.engine.blockSize {block_size} is supported by no CUDA attention backend of vLLM {version} "
        f"({', '.join(sorted(backends))}): they take {', '.join(map(str, usable))} tokens; use one of "
        "those, or leave blockSize unset and vLLM picks the backend's own"
    )
