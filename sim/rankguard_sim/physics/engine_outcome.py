"""Questions a benchmark asks the world: does a flag set crash, and how much KV is truly safe?

`outcome()` replays `EngineMemoryModel` over empty pure-ledger GPUs through the same ramp
levels the fake vLLM walks, so its answer is the fake's behaviour; `true_max_safe_kv()` is the
world's own bound that every KV strategy is scored against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rankguard_sim.physics.engine_config import EngineConfig, engine_config
from rankguard_sim.physics.engine_failures import EngineFailure
from rankguard_sim.physics.engine_measured import engine_model
from rankguard_sim.physics.engine_memory import EngineMemoryModel, PureLedger, rank_memory
from rankguard_sim.physics.scenario_data import Scenario, gib

# ---------------------------------------------------------------------------------------------
# Questions a benchmark asks


@dataclass(frozen=True)
class Outcome:
    crashes: bool
    rank: int | None  # the rank that failed (None when it does not crash)
    kv_bytes_per_rank: int  # KV cache allocated on the bottleneck view (min over ranks); 0 if none
    requested_bytes: int | None  # OOM: what PyTorch tried to allocate; start-up check: total × util
    free_bytes: int | None  # free on that GPU at that moment
    reason: str | None = None
    phase: str | None = None
    running_seqs: int | None = None  # the running batch when it crashed while serving
    num_gpu_blocks: int = 0
    kv_tokens: int = 0
    peak_running_seqs: int = 0  # the highest batch the load reached (capped by flags and KV)
    message: str | None = None


def outcome(
    scenario: Scenario,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    disable_custom_all_reduce: bool = False,
    other_used_bytes: Sequence[int] | None = None,
    max_cudagraph_capture_size: int | None = None,
    extensible_kv_cache: bool = False,
) -> Outcome:
    """Replay start-up and one full load cycle on empty GPUs: does this flag set crash, where?

    The fake vLLM runs the same `EngineMemoryModel` phases over the GPU files, walking the
    same ramp levels, so this answer is the fake's behaviour. Raises EngineConfigError for
    flags vLLM would reject before touching a GPU. `extensible_kv_cache`: vLLM 0.34's measured
    sizing (under `vllm_snapshot.playing("0.34.0")`; engine_measured).
    """
    config = engine_config(
        scenario,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=disable_custom_all_reduce,
        max_cudagraph_capture_size=max_cudagraph_capture_size,
        extensible_kv_cache=extensible_kv_cache,
    )
    return outcome_for_config(scenario, config, other_used_bytes=other_used_bytes)


def outcome_for_config(
    scenario: Scenario, config: EngineConfig, *, other_used_bytes: Sequence[int] | None = None
) -> Outcome:
    """`outcome()` for an already resolved configuration (e.g. `vllm_args.engine_config_from_argv`).

    Lets a caller that holds a `vllm serve` command line ask the world without restating
    every flag as a keyword.
    """
    ledger = PureLedger([scenario.gpu.total_bytes] * scenario.world_size, other_used_bytes)
    engine = engine_model(scenario, config, ledger)
    try:
        plan = engine.startup()
    except EngineFailure as failure:
        return _failed(failure, engine, None, 0)
    levels = engine.running_levels()
    peak = 0
    for running in levels:
        try:
            engine.begin_step(running)
        except EngineFailure as failure:
            return _failed(failure, engine, running, peak)
        peak = max(peak, running)
        engine.end_step()
    return Outcome(
        crashes=False,
        rank=None,
        kv_bytes_per_rank=min(plan.kv_bytes),
        requested_bytes=None,
        free_bytes=None,
        num_gpu_blocks=plan.num_gpu_blocks,
        kv_tokens=plan.num_tokens,
        peak_running_seqs=peak,
    )


def _failed(failure: EngineFailure, engine: EngineMemoryModel, running: int | None, peak: int) -> Outcome:
    plan = engine.plan
    return Outcome(
        crashes=True,
        rank=failure.rank,
        kv_bytes_per_rank=min(plan.kv_bytes) if plan is not None else 0,
        requested_bytes=failure.requested_bytes,
        free_bytes=failure.free_bytes,
        reason=failure.reason,
        phase=failure.phase,
        running_seqs=running,
        num_gpu_blocks=plan.num_gpu_blocks if plan is not None else 0,
        kv_tokens=plan.num_tokens if plan is not None else 0,
        peak_running_seqs=peak,
        message=failure.message(),
    )


@dataclass(frozen=True)
class SafeCapacity:
    """The world's own answer to "how much KV cache per rank can never crash?"."""

    kv_bytes: int  # min over ranks of the headroom left for KV at the scenario's peak load
    num_gpu_blocks: int  # the same in whole blocks (min over ranks)
    bottleneck_rank: int
    headroom_per_rank: tuple[int, ...]
    peak_running_seqs: int


def true_max_safe_kv(
    scenario: Scenario,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    disable_custom_all_reduce: bool = False,
    max_cudagraph_capture_size: int | None = None,
) -> SafeCapacity:
    """min over ranks of total − every non-KV byte − the transient peak at the scenario's max load.

    Every non-KV byte includes what the container's other processes hold on that GPU.

    Two moments bound each rank: serving at peak load (serving communicators + the logits of
    the peak batch) and the sampler warm-up at start-up (logits for max_num_seqs before the
    serving communicators exist). The peak batch is the load's peak capped by max_num_seqs;
    a smaller KV cache could cap it further, which only makes this bound conservative.
    """
    config = engine_config(
        scenario,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=disable_custom_all_reduce,
        max_cudagraph_capture_size=max_cudagraph_capture_size,
    )
    peak = min(scenario.load.peak_running_seqs, config.max_num_seqs)
    warmup = min(config.max_num_seqs, config.max_num_batched_tokens)
    headroom = []
    blocks = []
    for m in rank_memory(scenario, config):
        fixed = m.other_bytes + sum(n for _, n in m.late_others) + m.init + m.weights + m.cuda_graph
        worst = max(m.serving + m.transient(peak), m.transient(warmup))
        room = max(0, scenario.gpu.total_bytes - fixed - worst)
        headroom.append(room)
        blocks.append(room // m.block_bytes)
    bottleneck = min(range(len(headroom)), key=lambda r: (blocks[r], headroom[r]))
    return SafeCapacity(
        kv_bytes=min(headroom),
        num_gpu_blocks=min(blocks),
        bottleneck_rank=bottleneck,
        headroom_per_rank=tuple(headroom),
        peak_running_seqs=peak,
    )


def describe(scenario: Scenario) -> Iterator[str]:
    """Human-readable lines: the scenario's per-rank truth at its defaults (docs, debugging)."""
    config = engine_config(scenario)
    topology = f"TP{scenario.tensor_parallel_size}×PP{scenario.pipeline_parallel_size}"
    yield f"{scenario.name}: {scenario.model.name} {topology}"
    yield f"  GPU {scenario.gpu.name}: {gib(scenario.gpu.total_bytes):.2f} GiB"
    for m in rank_memory(scenario, config):
        yield (
            f"  rank {m.rank}: other processes {gib(m.other_bytes):.2f} GiB, init {gib(m.init):.2f} GiB, "
            f"weights {gib(m.weights):.2f}, profile "
            f"{gib(m.profile_peak):.2f}, graphs {gib(m.cuda_graph):.2f} "
            f"(estimated {gib(m.cuda_graph_estimate):.2f}), late others "
            f"{gib(sum(n for _, n in m.late_others)):.2f}, serving comm {gib(m.serving):.2f}, "
            f"logits {m.logits_per_seq} B/seq, sampler {m.sampler_per_seq} B/seq, "
            f"KV {m.kv_bytes_per_token} B/token"
        )
