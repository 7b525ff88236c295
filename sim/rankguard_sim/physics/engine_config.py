"""vLLM's engine flags, resolved against a scenario's defaults and checked as vLLM checks them."""

from __future__ import annotations

from dataclasses import dataclass

from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.vllm_snapshot import default_block_size, extensible_facts, kv_cache_dtypes, snapshot


def _dtype_choices() -> tuple[str, ...]:
    for opt in snapshot().cli["options"]:
        if opt["dest"] == "dtype":
            return tuple(str(c) for c in opt["choices"])
    raise LookupError("the vLLM snapshot has no --dtype option")


# vLLM's accepted values (from the snapshot: --dtype's choices, engine.json's KV cache dtypes);
# anything else is refused before start-up. The byte sizes are the world's knowledge of the
# ones it can simulate; a valid KV cache dtype it cannot size is refused as unsimulated.
DTYPES = _dtype_choices()
DTYPE_BYTES = {"half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4}
KV_CACHE_DTYPES = kv_cache_dtypes()
KV_CACHE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
assert set(DTYPE_BYTES) <= set(DTYPES) and set(KV_CACHE_DTYPE_BYTES) <= set(KV_CACHE_DTYPES)


class EngineConfigError(ValueError):
    """The flags cannot describe an engine for this scenario (vLLM would refuse to start)."""


class UnsimulatedConfig(EngineConfigError):
    """Flags vLLM builds a configuration from, which the simulated world cannot play (a topology
    or KV cache dtype the scenario has no measurements for, a negative KV budget): the fake
    engine fails to start on them, but the pod's judge must not call them vLLM's refusal."""


# vLLM 0.33's default ceiling of the CUDA graph capture sizes off data-center Blackwell
# (vllm/config/vllm.py:2464-2470: 1024 on capability family 100, else 512).
DEFAULT_MAX_GRAPH_SIZE = 512


def cudagraph_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, max_cudagraph_capture_size: int | None
) -> tuple[int, ...]:
    """The batch sizes vLLM 0.33 captures CUDA graphs for, without speculative decoding.

    vllm/config/vllm.py `_set_cudagraph_sizes` (lines 2447-2631): the ceiling is the flag, else
    min(max_num_seqs × 2, 512) (2460-2470); it is capped at max_num_batched_tokens (2551-2552);
    the list is [1, 2, 4] + range(8, min(ceiling + 1, 256), 8) + range(256, ceiling + 1, 16)
    (2578-2591), plus max_num_batched_tokens when within the ceiling (2592-2597), plus
    max_num_seqs when the ceiling was the default and covers it (uniform_decode_sizes,
    2549-2550); the effective maximum is the list's last item (2609-2631). The same rule is
    CompilationConfig.max_cudagraph_capture_size's docstring (vllm/config/compilation.py:695-711).
    """
    ceiling = max_cudagraph_capture_size
    decode: list[int] = []
    if ceiling is None:
        ceiling = min(max_num_seqs * 2, DEFAULT_MAX_GRAPH_SIZE)
        if max_num_seqs <= ceiling:
            decode = [max_num_seqs]
    ceiling = min(max_num_batched_tokens, ceiling)
    if ceiling < 1:
        # vLLM's assertion (vllm/config/vllm.py:2554-2557)
        raise EngineConfigError(
            "Maximum cudagraph size should be greater than or equal to 1 when using cuda graph."
        )
    sizes = [i for i in (1, 2, 4) if i <= ceiling]
    if ceiling >= 8:
        sizes += list(range(8, min(ceiling + 1, 256), 8))
    if ceiling >= 256:
        sizes += list(range(256, ceiling + 1, 16))
    if max_num_batched_tokens <= ceiling:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in decode if s <= max_num_batched_tokens]
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class EngineConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    enforce_eager: bool
    disable_custom_all_reduce: bool
    max_model_len_auto: bool = False  # --max-model-len auto / -1: fit to the KV cache memory
    nnodes: int = 1  # --nnodes: the nodes (pods) the world spans
    # the largest CUDA graph vLLM captures (its effective --max-cudagraph-capture-size after
    # `cudagraph_capture_sizes`); 0 under --enforce-eager, where nothing is captured
    max_cudagraph_capture_size: int = 0
    # vLLM 0.34's extensible KV cache (physics/extensible_kv.resolve_mode): sized after warm-up
    extensible_kv_cache: bool = False
    explicit_utilization: float | None = None  # --gpu-memory-utilization as given (None: unset)

    @property
    def dtype_bytes_override(self) -> int | None:
        return DTYPE_BYTES.get(self.dtype)


def engine_config(
    scenario: Scenario,
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    disable_custom_all_reduce: bool = False,
    allow_long_max_model_len: bool = False,
    nnodes: int | None = None,
    max_cudagraph_capture_size: int | None = None,
    extensible_kv_cache: bool = False,
) -> EngineConfig:
    """Fill vLLM's defaults for this scenario's GPU and check what vLLM checks at config time.

    An unset utilisation is the scenario's default, except on a release with the extensible KV
    cache (0.34), whose default follows the mode (its `resolved_gpu_memory_utilization`)."""
    tp = scenario.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
    pp = scenario.pipeline_parallel_size if pipeline_parallel_size is None else pipeline_parallel_size
    if (tp, pp) != (scenario.tensor_parallel_size, scenario.pipeline_parallel_size):
        raise UnsimulatedConfig(
            f"scenario {scenario.name} describes TP{scenario.tensor_parallel_size}×"
            f"PP{scenario.pipeline_parallel_size}; the simulated world has no measurements for TP{tp}×PP{pp}"
        )
    nodes = scenario.nnodes if nnodes is None else nnodes
    if nodes != scenario.nnodes:
        raise UnsimulatedConfig(
            f"scenario {scenario.name} describes its world over {scenario.nnodes} node(s); the "
            f"simulated world has no measurements for it over {nodes}"
        )
    util = _utilization(scenario, gpu_memory_utilization, extensible_kv_cache)
    if not 0.0 < util <= 1.0:
        raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 0:
        raise UnsimulatedConfig(f"kv_cache_memory_bytes must be >= 0, got {kv_cache_memory_bytes}")
    seqs = scenario.defaults.max_num_seqs if max_num_seqs is None else max_num_seqs
    if seqs < 1:
        raise EngineConfigError(f"max_num_seqs must be >= 1, got {seqs}")
    tokens = (
        scenario.defaults.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    )
    if tokens < 1:
        raise EngineConfigError(f"max_num_batched_tokens must be >= 1, got {tokens}")
    derived_len = scenario.model.max_position_embeddings
    auto = max_model_len == -1  # vLLM: -1 (or "auto") is the derived length, auto-fitted later
    length = derived_len if max_model_len is None or auto else max_model_len
    if length < 1:
        raise EngineConfigError(f"max_model_len must be >= 1, got {length}")
    if length > derived_len and not allow_long_max_model_len:
        # vLLM's wording (ModelConfig), shortened to its first two sentences.
        raise EngineConfigError(
            f"User-specified max_model_len ({length}) is greater than the derived max_model_len "
            f"(max_position_embeddings={derived_len} or model_max_length=None in model's config.json). "
            "To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    blocks = default_block_size() if block_size is None else block_size  # CacheConfig's default
    if blocks < 1:
        raise EngineConfigError(f"block_size must be > 0, got {blocks}")
    if dtype not in DTYPES:
        raise EngineConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:  # vLLM's CacheConfig validator refuses it too
        raise EngineConfigError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise UnsimulatedConfig(
            f"kv_cache_dtype {kv_cache_dtype!r} is valid for vLLM, but the simulated world has no "
            f"measurements for it (simulated: auto, {', '.join(KV_CACHE_DTYPE_BYTES)})"
        )
    capture = 0 if enforce_eager else cudagraph_capture_sizes(seqs, tokens, max_cudagraph_capture_size)[-1]
    return EngineConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        gpu_memory_utilization=util,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        max_model_len=length,
        block_size=blocks,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=disable_custom_all_reduce,
        max_model_len_auto=auto,
        nnodes=nodes,
        max_cudagraph_capture_size=capture,
        extensible_kv_cache=extensible_kv_cache,
        explicit_utilization=gpu_memory_utilization,
    )


def _utilization(scenario: Scenario, given: float | None, extensible_kv_cache: bool) -> float:
    if given is not None:
        return given
    facts = extensible_facts()
    if facts is None:
        return scenario.defaults.gpu_memory_utilization
    key = "default_utilization" if extensible_kv_cache else "estimate_default_utilization"
    return float(facts[key])
