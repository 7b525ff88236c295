"""`ServiceSpec`: an LLMService's `spec`, parsed and checked, with the CRD's defaults applied.

It mirrors the CRD's spec section by section, one parser per section, so a reader can hold it
against crds/llmservice.yaml (its defaults and enums are `spec.crd`'s; the field readers live in
`spec.fields`, the pod's sections in `spec.pod` and `spec.template`).

The API server already validates and defaults the spec (crds/llmservice.yaml, OpenAPI +
CEL), but the operator must not trust that alone: it can run against an older CRD, and tests
and the CLI build specs by hand. So `parse_spec` applies the same defaults and checks the same
rules, plus one the CRD's regex cannot express exactly: extraArgs read as the image's vLLM
reads them (its recorded CLI), so an unknown flag, a bad value or an owned flag in any
spelling is refused before anything is deployed. Every `SpecError` names the field and says
what to change.

Pure: no I/O (a ConfigMap holding config.json is read by the caller and passed in).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rankguard_operator.core.engine.owned_flags import (
    RUNTIME_QUANTIZATION,
    capture_sizes_flag,
    check_extra_args,
    check_group_args,
    chunked_prefill_off,
    served_model_name,
)
from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.engine.surface import block_size_problem, check_host_memory, check_surface
from rankguard_operator.core.spec.crd import (
    BLOCK_SIZES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MIN_HEADROOM_BYTES,
    DEFAULT_SAFETY_MARGIN_BYTES,
    DEFAULT_STARTUP_TIMEOUT_SECONDS,
    DTYPES,
    KV_CACHE_DTYPES,
    LISTEN_ADDRESSES,
    LOGITS_MODES,
    MAX_GPU_BYTES,
    MAX_GPUS_PER_REPLICA,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MIN_PINNED_KV_BYTES,
    SHAPE_OVERRIDE_KEYS,
)
from rankguard_operator.core.spec.distributed import DistributedSpec, parse_distributed
from rankguard_operator.core.spec.fields import (
    SpecError,
    bool_field,
    choice_field,
    int_field,
    number_field,
    required_int,
    section,
    str_field,
)
from rankguard_operator.core.spec.pod import (
    AgentSpec,
    ModelCacheSpec,
    ResourcesSpec,
    parse_agent,
    parse_model_cache,
    parse_resources,
)
from rankguard_operator.core.spec.remediation import RemediationSpec, parse_remediation
from rankguard_operator.core.spec.template import PodTemplate, parse_template, vllm_env_names


@dataclass(frozen=True)
class ModelSpec:
    name: str
    shape: Mapping[str, Any] | None = None  # camelCase override keys, as in the CRD
    config_map: str | None = None
    config_map_key: str = "config.json"
    quantization: str | None = None  # vLLM --quantization on an unquantised checkpoint (fp8)


@dataclass(frozen=True)
class EngineSpec:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None  # None: vLLM picks it per attention backend; not rendered
    enforce_eager: bool = False
    logits_mode: str = "all-gather"
    extra_args: tuple[str, ...] = ()
    startup_timeout_seconds: int = DEFAULT_STARTUP_TIMEOUT_SECONDS  # the startup probe's budget
    # what extraArgs say that limits the OOM levers (read with the image's vLLM CLI): the flag
    # that sets CUDA-graph capture sizes (rankguard then leaves the capture size alone), and
    # chunked prefill turned off (then max_num_batched_tokens stays >= max_model_len)
    capture_sizes_flag: str | None = None
    chunked_prefill_off: bool = False
    # extraArgs' --served-model-name (its first value): the `model_name` label of vLLM's metrics
    served_model_name: str | None = None


@dataclass(frozen=True)
class MemorySpec:
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # pinned: rankguard never changes it
    safety_margin_bytes: int = DEFAULT_SAFETY_MARGIN_BYTES
    min_headroom_bytes: int = DEFAULT_MIN_HEADROOM_BYTES
    reclaim: bool = True
    gpu_memory_bytes: int | None = None

    @property
    def pinned(self) -> bool:
        return self.kv_cache_memory_bytes is not None


@dataclass(frozen=True)
class ServiceSpec:
    model: ModelSpec
    image: str
    replicas: int = 1
    tp: int = 1
    pp: int = 1
    engine: EngineSpec = field(default_factory=EngineSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    remediation: RemediationSpec = field(default_factory=RemediationSpec)
    agent: AgentSpec = field(default_factory=AgentSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    listen_address: str = LISTEN_ADDRESSES[0]
    model_cache: ModelCacheSpec | None = None
    template: PodTemplate = field(default_factory=PodTemplate)
    distributed: DistributedSpec | None = None  # None: one pod per replica

    @property
    def world_size(self) -> int:
        """GPUs per replica (one pod, or one group of pods): tensorParallelSize × pipelineParallelSize."""
        return self.tp * self.pp

    @property
    def pods_per_replica(self) -> int:
        return 1 if self.distributed is None else self.distributed.pods_per_group

    @property
    def gpus_per_pod(self) -> int:
        """GPUs each serving pod asks for: the world size, or its share of the group."""
        return self.world_size // self.pods_per_replica


# --------------------------------------------------------------------------------------------
# Sections


def _parse_model(spec: Mapping[str, Any]) -> ModelSpec:
    if "model" not in spec:
        raise SpecError("spec.model is required: give spec.model.name, e.g. meta-llama/Meta-Llama-3-70B")
    m = section(spec, "model", "spec")
    name = str_field(m, "name", "spec.model", None, max_len=512)
    if name is None:
        raise SpecError("spec.model.name is required, e.g. meta-llama/Meta-Llama-3-70B")
    shape_raw = m.get("shape")
    shape: dict[str, Any] | None = None
    if shape_raw is not None:
        if not isinstance(shape_raw, Mapping):
            raise SpecError("spec.model.shape must be an object of config.json figures (camelCase)")
        unknown = sorted(set(shape_raw) - set(SHAPE_OVERRIDE_KEYS))
        if unknown:
            raise SpecError(
                f"spec.model.shape has unknown field(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(SHAPE_OVERRIDE_KEYS)}"
            )
        for k, v in shape_raw.items():
            if v is None:
                continue
            if k == "tieWordEmbeddings":
                if not isinstance(v, bool):
                    raise SpecError(
                        f"spec.model.shape.tieWordEmbeddings must be true or false, got {v!r:.60}"
                    )
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"spec.model.shape.{k} must be a positive integer, got {v!r:.60}")
        shape = dict(shape_raw)
    cm = m.get("configMap")
    cm_name: str | None = None
    cm_key = "config.json"
    if cm is not None:
        if not isinstance(cm, Mapping):
            raise SpecError("spec.model.configMap must be an object with name (and optional key)")
        cm_name = str_field(cm, "name", "spec.model.configMap", None, max_len=253)
        if cm_name is None:
            raise SpecError("spec.model.configMap.name is required: the ConfigMap that holds config.json")
        cm_key = str_field(cm, "key", "spec.model.configMap", "config.json", max_len=253) or "config.json"
    if shape is not None and cm_name is not None:
        raise SpecError(
            "give spec.model.shape or spec.model.configMap, not both: each fully describes the "
            "model's architecture"
        )
    quant = str_field(m, "quantization", "spec.model", None, max_len=32)
    if quant is not None and quant not in RUNTIME_QUANTIZATION:
        raise SpecError(
            f"spec.model.quantization {quant!r} is not one of {', '.join(RUNTIME_QUANTIZATION)}: rankguard "
            "sizes vLLM's runtime FP8 quantisation; a pre-quantised checkpoint says its own format in "
            "config.json"
        )
    return ModelSpec(name=name, shape=shape, config_map=cm_name, config_map_key=cm_key, quantization=quant)


def _parse_engine(spec: Mapping[str, Any]) -> EngineSpec:
    w = "spec.engine"
    e = section(spec, "engine", "spec")
    max_num_seqs = required_int(e, "maxNumSeqs", w, DEFAULT_MAX_NUM_SEQS, lo=1, hi=MAX_NUM_SEQS)
    batched = required_int(
        e, "maxNumBatchedTokens", w, DEFAULT_MAX_NUM_BATCHED_TOKENS, lo=1, hi=MAX_NUM_BATCHED_TOKENS
    )
    if batched < max_num_seqs:
        raise SpecError(
            f"spec.engine.maxNumBatchedTokens ({batched}) must be >= spec.engine.maxNumSeqs "
            f"({max_num_seqs}) (vLLM refuses to start otherwise); raise maxNumBatchedTokens or lower "
            "maxNumSeqs"
        )
    raw_extra = e.get("extraArgs") or []
    if not isinstance(raw_extra, list) or not all(isinstance(a, str) for a in raw_extra):
        raise SpecError("spec.engine.extraArgs must be a list of strings, e.g. ['--enable-prefix-caching']")
    if len(raw_extra) > 64:
        raise SpecError(f"spec.engine.extraArgs has {len(raw_extra)} entries; at most 64 are allowed")
    return EngineSpec(
        max_num_seqs=max_num_seqs,
        max_model_len=int_field(e, "maxModelLen", w, None, lo=1, hi=100_000_000),
        max_num_batched_tokens=batched,
        dtype=choice_field(e, "dtype", w, "auto", DTYPES),
        kv_cache_dtype=choice_field(e, "kvCacheDtype", w, "auto", KV_CACHE_DTYPES),
        block_size=_block_size(e),
        enforce_eager=bool_field(e, "enforceEager", w, False),
        logits_mode=choice_field(e, "logitsMode", w, "all-gather", LOGITS_MODES),
        extra_args=tuple(raw_extra),
        startup_timeout_seconds=required_int(
            e, "startupTimeoutSeconds", w, DEFAULT_STARTUP_TIMEOUT_SECONDS, lo=60, hi=86400
        ),
    )


def _block_size(e: Mapping[str, Any]) -> int | None:
    v = int_field(e, "blockSize", "spec.engine", None, lo=1)
    if v is not None and v not in BLOCK_SIZES:
        raise SpecError(
            f"spec.engine.blockSize must be one of {', '.join(map(str, BLOCK_SIZES))} tokens, got {v}"
        )
    return v


def _parse_memory(spec: Mapping[str, Any]) -> MemorySpec:
    w = "spec.memory"
    m = section(spec, "memory", "spec")
    util = number_field(m, "gpuMemoryUtilization", w, None, lo=0.0, hi=0.99)
    if util is not None and util <= 0:
        raise SpecError("spec.memory.gpuMemoryUtilization must be above 0 (a fraction of each GPU's memory)")
    kv = int_field(m, "kvCacheMemoryBytes", w, None, lo=1, hi=MAX_GPU_BYTES)
    if kv is not None and kv < MIN_PINNED_KV_BYTES:
        raise SpecError(
            f"spec.memory.kvCacheMemoryBytes must be at least {MIN_PINNED_KV_BYTES} (1 MiB), got {kv}: "
            "it is in bytes, per GPU (e.g. 42949672960 for 40 GiB), and no model holds one request in less"
        )
    if util is not None and kv is not None:
        raise SpecError(
            "set spec.memory.kvCacheMemoryBytes (a pinned per-GPU KV budget) or "
            "spec.memory.gpuMemoryUtilization (a starting fraction), not both; leave both unset to let "
            "rankguard plan the budget per rank"
        )
    margin = required_int(m, "safetyMarginBytes", w, DEFAULT_SAFETY_MARGIN_BYTES, lo=0, hi=MAX_GPU_BYTES)
    min_headroom = required_int(m, "minHeadroomBytes", w, DEFAULT_MIN_HEADROOM_BYTES, lo=0, hi=MAX_GPU_BYTES)
    if min_headroom > margin:
        raise SpecError(
            f"spec.memory.minHeadroomBytes ({min_headroom}) must not exceed spec.memory.safetyMarginBytes "
            f"({margin}): a budget planned with that margin would count as memory pressure at once"
        )
    gpu = int_field(m, "gpuMemoryBytes", w, None, lo=1, hi=MAX_GPU_BYTES)
    if kv is not None and gpu is not None and kv >= gpu:
        raise SpecError(
            "spec.memory.kvCacheMemoryBytes must be smaller than spec.memory.gpuMemoryBytes: the KV cache "
            "shares each GPU with the weights, activations and NCCL buffers"
        )
    return MemorySpec(
        gpu_memory_utilization=util,
        kv_cache_memory_bytes=kv,
        safety_margin_bytes=margin,
        min_headroom_bytes=min_headroom,
        reclaim=bool_field(m, "reclaim", w, True),
        gpu_memory_bytes=gpu,
    )


def parse_spec(spec: Mapping[str, Any]) -> ServiceSpec:
    """Parse an LLMService's `spec` (camelCase, as the API returns it). Raises `SpecError`."""
    if not isinstance(spec, Mapping):
        raise SpecError(f"spec must be an object, got {type(spec).__name__}")
    model = _parse_model(spec)
    image = str_field(spec, "image", "spec", None)
    if image is None:
        raise SpecError("spec.image is required: the vLLM image, e.g. vllm/vllm-openai:v0.33.0")
    tp = required_int(spec, "tensorParallelSize", "spec", 1, lo=1, hi=MAX_GPUS_PER_REPLICA)
    pp = required_int(spec, "pipelineParallelSize", "spec", 1, lo=1, hi=MAX_GPUS_PER_REPLICA)
    if tp * pp > MAX_GPUS_PER_REPLICA:
        raise SpecError(
            f"spec.tensorParallelSize × spec.pipelineParallelSize ({tp} × {pp} = {tp * pp} GPUs per replica) "
            f"must be at most {MAX_GPUS_PER_REPLICA}; lower one of them"
        )
    memory = _parse_memory(spec)
    engine = _parse_engine(spec)
    # extraArgs are read the way the image's vLLM reads them (its recorded CLI: every flag,
    # alias and value type), so what vLLM would refuse is refused here, before a roll.
    rules = rules_for_image(image)
    cli = rules.cli
    problems = check_extra_args(engine.extra_args, cli)
    agent = parse_agent(spec)
    distributed = parse_distributed(spec, tp, pp, agent.port)
    if distributed is not None:
        problems += check_group_args(engine.extra_args, cli)
    if engine.block_size is not None:
        block = block_size_problem(rules.snapshot.surface, engine.block_size, rules.version, BLOCK_SIZES)
        problems += [block] if block else []
    # ... and what a rankguard pod cannot run with: another world size, no HTTP on the port, a
    # launcher, rules vLLM checks before it loads anything, more host memory than the limit
    problems = problems or check_surface(engine.extra_args, cli, tp, pp)
    resources = parse_resources(spec)
    gpus_per_pod = tp * pp // (1 if distributed is None else distributed.pods_per_group)
    problems = problems or check_host_memory(
        engine.extra_args, cli, gpus_per_pod, resources.memory_limit_bytes
    )
    if problems:
        raise SpecError("; ".join(problems))
    engine = replace(
        engine,
        capture_sizes_flag=capture_sizes_flag(engine.extra_args, cli),
        chunked_prefill_off=chunked_prefill_off(engine.extra_args, cli),
        served_model_name=served_model_name(engine.extra_args, cli),
    )
    cache = parse_model_cache(spec)
    template = parse_template(spec.get("template"), cache.mount_path if cache is not None else None)
    if distributed is not None:
        _check_group_env(template, distributed)
    return ServiceSpec(
        model=model,
        image=image,
        replicas=required_int(spec, "replicas", "spec", 1, lo=0, hi=1000),
        tp=tp,
        pp=pp,
        engine=engine,
        memory=memory,
        remediation=parse_remediation(
            spec, gpu_memory_bytes=memory.gpu_memory_bytes, pinned_kv_bytes=memory.kv_cache_memory_bytes
        ),
        agent=agent,
        resources=resources,
        listen_address=choice_field(spec, "listenAddress", "spec", LISTEN_ADDRESSES[0], LISTEN_ADDRESSES),
        model_cache=cache,
        template=template,
        distributed=distributed,
    )


# The env rankguard sets on a group's vLLM containers (core/render/group), and with
# spec.distributed.networkInterface the interface NCCL and Gloo use.
GROUP_ENV = ("VLLM_HOST_IP", "RANKGUARD_NODE_RANK")
INTERFACE_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _check_group_env(template: PodTemplate, distributed: DistributedSpec) -> None:
    owned = GROUP_ENV + (INTERFACE_ENV if distributed.network_interface is not None else ())
    for name in vllm_env_names(template):
        if name in owned:
            why = (
                "spec.distributed.networkInterface sets it"
                if name in INTERFACE_ENV
                else "rankguard sets it on every pod of a group (the pod's IP, its node rank)"
            )
            raise SpecError(f"spec.template.spec.containers[vllm].env cannot set {name}: {why}")
