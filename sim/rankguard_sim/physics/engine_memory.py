"""vLLM v1's memory behaviour over a scenario: per-rank bytes by phase, replayed over a ledger.

(Over 450 lines because `EngineMemoryModel` is vLLM's start-up and serving sequence in the
order vLLM runs it, per phase: other processes, init, weights, profile, KV, graphs, warm-up,
steps, and the per-worker report it prints; one sequence, read top to bottom.)

`rank_memory` turns a scenario and an engine configuration into each rank's bytes;
`EngineMemoryModel` replays vLLM v1's start-up and serving sequence over a `Ledger` (what is
free on each GPU). The fake vLLM runs it over the simulated GPU files; `engine_outcome`
runs it over a `PureLedger`, so a benchmark asks the same question the fake answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rankguard_sim.physics.engine_config import (
    KV_CACHE_DTYPE_BYTES,
    EngineConfig,
    cudagraph_capture_sizes,
)
from rankguard_sim.physics.engine_failures import (
    CudaOutOfMemory,
    GpuLost,
    KVCacheTooSmall,
    NoKVCacheMemory,
    SamplerWarmupOOM,
    StartupFreeMemoryError,
    kv_memory_hint,
)
from rankguard_sim.physics.scenario_data import MIB, PHASES, Scenario
from rankguard_sim.vllm_snapshot import null_blocks

# vLLM's gpu_worker.py leaves this much when it suggests a --kv-cache-memory-bytes value
# ("empirically observed that the memory profiling may slightly underestimate").
REDUNDANCY_BUFFER_BYTES = 150 * MIB


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes under one engine configuration, by the phase that allocates them."""

    rank: int
    others: tuple[tuple[str, int], ...]  # other processes' memory on this GPU (API server, ...)
    init: int  # CUDA context + communicators, before vLLM's memory snapshot
    weights: int
    profile_peak: int  # freed again after profile_run
    cuda_graph: int  # captured after the KV cache; vLLM subtracts its estimate of it
    serving: int  # communicator memory that first appears with real traffic
    logits_per_seq: int  # the transient that grows with the running batch
    kv_bytes_per_token: int
    block_bytes: int  # one KV block across this rank's layers
    cuda_graph_estimate: int = 0  # what vLLM's profiler estimates of `cuda_graph` (and budgets)
    late_others: tuple[tuple[str, int], ...] = ()  # other processes that start after the snapshot
    sampler_per_seq: int = 0  # the sampler's working set per sequence, beyond the logits

    @property
    def other_bytes(self) -> int:
        return sum(n for _, n in self.others)

    def transient(self, running_seqs: int) -> int:
        """The logits and the sampler's working set for `running_seqs` sequences."""
        return (self.logits_per_seq + self.sampler_per_seq) * max(0, running_seqs)

    @property
    def holds_logits(self) -> bool:
        return self.logits_per_seq > 0


def _logits_per_seq(s: Scenario, rank: int) -> int:
    if not s.is_last_stage(rank):
        return 0  # earlier pipeline stages hand hidden states on; they never see logits
    vocab, tp, nbytes = s.model.vocab_size, s.tensor_parallel_size, s.logits.dtype_bytes
    if s.logits.mode == "all_gather" or tp == 1 or s.tp_rank(rank) == 0:
        return vocab * nbytes
    return math.ceil(vocab / tp) * nbytes  # the partial logits a non-driver rank computes


def default_capture_size(scenario: Scenario) -> int:
    """The largest CUDA graph vLLM captures at the scenario's defaults (what its cuda_graph
    bytes are given for)."""
    d = scenario.defaults
    return cudagraph_capture_sizes(d.max_num_seqs, d.max_num_batched_tokens, None)[-1]


def rank_memory(scenario: Scenario, config: EngineConfig) -> list[RankMemory]:
    """Each rank's bytes under `config`: the scenario's components, scaled by the flags they grow
    with (batched tokens: the profile run's activations; max_num_seqs: the dummy sampler;
    the capture size: the CUDA graph pool), the graph pool gone under --enforce-eager."""
    model_dtype = scenario.model.dtype_bytes
    d = scenario.defaults
    default_dummy = min(d.max_num_seqs, d.max_num_batched_tokens)
    dummy = min(config.max_num_seqs, config.max_num_batched_tokens)
    capture_default = default_capture_size(scenario)
    dtype_bytes = config.dtype_bytes_override or model_dtype
    kv_dtype_bytes = KV_CACHE_DTYPE_BYTES.get(config.kv_cache_dtype, dtype_bytes)
    kv_heads = max(1, scenario.model.num_kv_heads // scenario.tensor_parallel_size)
    out = []
    for rank in range(scenario.world_size):
        phases = dict.fromkeys(PHASES, 0)
        others: list[tuple[str, int]] = []
        late: list[tuple[str, int]] = []
        unprofiled_graphs = 0
        for c in scenario.components:
            nbytes = c.bytes_for(rank)
            if c.phase in ("other_process", "late_other_process"):
                if nbytes:
                    (others if c.phase == "other_process" else late).append((c.name, nbytes))
                continue
            if c.disabled_by == "disable_custom_all_reduce" and config.disable_custom_all_reduce:
                continue
            if (c.disabled_by == "enforce_eager" or c.phase == "cuda_graph") and config.enforce_eager:
                continue
            if c.scales_with == "max_num_batched_tokens":
                nbytes = nbytes * config.max_num_batched_tokens // scenario.defaults.max_num_batched_tokens
            elif c.scales_with == "max_num_seqs":
                nbytes = nbytes * dummy // default_dummy
            elif c.scales_with == "max_cudagraph_capture_size":
                nbytes = nbytes * config.max_cudagraph_capture_size // capture_default
            elif c.scales_with == "dtype":
                nbytes = nbytes * dtype_bytes // model_dtype
            phases[c.phase] += nbytes
            if c.phase == "cuda_graph" and not c.profiled:
                unprofiled_graphs += nbytes
        layers = scenario.layers_on_stage(scenario.pp_rank(rank))
        per_token = layers * 2 * kv_heads * scenario.model.head_dim * kv_dtype_bytes
        logits = _logits_per_seq(scenario, rank)
        # the sampler runs where the logits are (the last pipeline stage)
        sampler = phases["sampler"] // default_dummy if logits else 0
        out.append(
            RankMemory(
                rank=rank,
                others=tuple(others),
                init=phases["init"],
                weights=phases["weights"],
                # profile_run's dummy sampler holds its working set for the dummy requests
                profile_peak=phases["profile"] + sampler * dummy,
                cuda_graph=phases["cuda_graph"],
                serving=phases["serving"],
                logits_per_seq=logits,
                kv_bytes_per_token=per_token,
                block_bytes=per_token * config.block_size,
                cuda_graph_estimate=phases["cuda_graph"] - unprofiled_graphs,
                late_others=tuple(late),
                sampler_per_seq=sampler,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# vLLM v1's memory sequence over a ledger


class Ledger(Protocol):
    """What the engine can see of its GPUs: one process, its i-th rank on the pod's i-th GPU
    (global rank i, unless the world spans nodes)."""

    def total(self, rank: int) -> int: ...

    def free(self, rank: int) -> int: ...

    def held(self, rank: int, tag: str) -> int: ...

    def hold(self, rank: int, tag: str, nbytes: int) -> None: ...

    def others(self, rank: int) -> list[tuple[int, int]]: ...

    def start_other(self, rank: int, name: str, nbytes: int) -> None:
        """Another process of the engine's container takes `nbytes` on this rank's GPU."""
        ...

    def lost(self, rank: int) -> bool: ...


class PureLedger:
    """GPUs that exist only in memory (for `outcome()` and the tests)."""

    def __init__(self, totals: Sequence[int], others_used: Sequence[int] | None = None) -> None:
        self.totals = list(totals)
        self.others_used = list(others_used) if others_used is not None else [0] * len(self.totals)
        self.started: list[list[int]] = [[] for _ in self.totals]  # start_other, per rank
        self.tags: list[dict[str, int]] = [{} for _ in self.totals]

    def total(self, rank: int) -> int:
        return self.totals[rank]

    def used(self, rank: int) -> int:
        return self.others_used[rank] + sum(self.started[rank]) + sum(self.tags[rank].values())

    def free(self, rank: int) -> int:
        return max(0, self.totals[rank] - self.used(rank))

    def held(self, rank: int, tag: str) -> int:
        return self.tags[rank].get(tag, 0)

    def hold(self, rank: int, tag: str, nbytes: int) -> None:
        if nbytes:
            self.tags[rank][tag] = nbytes
        else:
            self.tags[rank].pop(tag, None)

    def others(self, rank: int) -> list[tuple[int, int]]:
        found = [self.others_used[rank], *self.started[rank]]
        return [(0, n) for n in found if n]

    def start_other(self, rank: int, name: str, nbytes: int) -> None:
        self.started[rank].append(nbytes)

    def lost(self, rank: int) -> bool:
        return False


# Tags: how the engine's memory splits for the OOM message (non-PyTorch vs PyTorch vs pools).
TAG_INIT = "init"
TAG_WEIGHTS = "weights"
TAG_PROFILE = "profile"
TAG_KV = "kv_cache"
TAG_GRAPHS = "cuda_graphs"
TAG_SERVING_COMM = "serving_comm"
TAG_TRANSIENT = "logits"
_TORCH_TAGS = (TAG_WEIGHTS, TAG_PROFILE, TAG_KV, TAG_TRANSIENT, TAG_GRAPHS)
ALL_TAGS = (TAG_INIT, *_TORCH_TAGS, TAG_SERVING_COMM)


@dataclass(frozen=True)
class KVPlan:
    available: tuple[int, ...]  # per rank, what each worker reports (vLLM's "Available KV cache memory")
    requested: tuple[int, ...]  # per rank, total × utilisation
    num_gpu_blocks: int  # the engine core's minimum over workers (the null block included)
    kv_bytes: tuple[int, ...]  # per rank, what is actually allocated
    block_size: int
    pinned: bool
    max_model_len: int = 0  # after auto-fit (--max-model-len auto)
    null_blocks: int = 1  # BlockPool holds these back for good

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can get: BlockPool pops the null block off the free queue at start."""
        return max(0, self.num_gpu_blocks - self.null_blocks)

    @property
    def blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def max_concurrency(self) -> float:
        """vLLM's get_max_concurrency_for_kv_cache_config: num_blocks / blocks per request."""
        return self.num_gpu_blocks / self.blocks_per_request

    @property
    def num_tokens(self) -> int:
        """What vLLM logs as the KV cache size: int(max_concurrency × max_model_len).

        vLLM 0.33 computes it from the pool's num_blocks, null block included
        (kv_cache_utils.get_kv_cache_capacity), so the fake prints the same number.
        """
        return int(self.max_concurrency * self.max_model_len)


@dataclass(frozen=True)
class WorkerMemoryReport:
    """The figures of vLLM's per-worker memory report (gpu_worker.py, utilisation path only)."""

    init_free: int
    total: int
    utilization: float
    requested: int
    total_consumed: int  # weights + non-torch growth since the snapshot
    peak_activation: int  # profile peak + the CUDA graph estimate vLLM subtracted
    cuda_graph: int  # what capture_model really took
    kv_to_requested_limit: int
    kv_to_gpu_limit: int
    available_kv: int


class EngineMemoryModel:
    """vLLM v1's start-up and serving memory sequence, one phase per method.

    Sources: vllm/v1/worker/gpu_worker.py (init_device takes the snapshot after NCCL init
    and refuses to start when free < total × utilisation; determine_available_memory;
    compile_or_warm_up_model captures CUDA graphs, then warms the sampler on the last
    pipeline stage), vllm/v1/core/kv_cache_utils.py (the engine core takes the minimum of
    the workers' block counts), and reference/vllm-memory-facts.md.

    `ranks`: the global ranks this process holds, on its ledger's GPUs 0, 1, … in that order
    (one node of a world over several, `Scenario.node_ranks`); None is every rank. The KV plan
    is always the whole world's (`plan_kv` takes every rank's available memory).
    """

    def __init__(
        self, scenario: Scenario, config: EngineConfig, ledger: Ledger, ranks: Sequence[int] | None = None
    ) -> None:
        self.scenario = scenario
        self.config = config
        self.ledger = ledger
        self.all_ranks = rank_memory(scenario, config)
        held = range(scenario.world_size) if ranks is None else ranks
        self.ranks = [self.all_ranks[r] for r in held]
        self._device = {m.rank: i for i, m in enumerate(self.ranks)}  # global rank -> ledger GPU
        self.plan: KVPlan | None = None
        self.snapshot_free: list[int] = []  # free memory per held rank at vLLM's memory snapshot
        self.requested: list[int] = []  # per held rank, total × utilisation
        self.serving_started = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def device(self, rank: int) -> int:
        """The GPU (ledger index, PyTorch's local "GPU i") that holds global rank `rank`."""
        return self._device[rank]

    # -- allocation ---------------------------------------------------------------------------

    def _allocate(self, rank: int, tag: str, nbytes: int, phase: str) -> None:
        dev = self._device[rank]
        if self.ledger.lost(dev):
            raise GpuLost(rank, phase)
        if nbytes <= 0:
            return
        free = self.ledger.free(dev)
        if nbytes > free:
            held = {t: self.ledger.held(dev, t) for t in ALL_TAGS}
            raise CudaOutOfMemory(
                rank,
                phase,
                nbytes=nbytes,
                free=free,
                total=self.ledger.total(dev),
                process_bytes=sum(held.values()),
                torch_allocated=sum(held[t] for t in _TORCH_TAGS),
                private_pools=held[TAG_GRAPHS],
                others=self.ledger.others(dev),
                what=tag,
                device=dev,
            )
        self.ledger.hold(dev, tag, self.ledger.held(dev, tag) + nbytes)

    def _release(self, rank: int, tag: str) -> None:
        self.ledger.hold(self._device[rank], tag, 0)

    def release_all(self) -> None:
        for m in self.ranks:
            for tag in ALL_TAGS:
                self._release(m.rank, tag)

    def check_gpus(self, phase: str) -> None:
        """GpuLost for the first held rank whose GPU has fallen off the bus."""
        for m in self.ranks:
            if self.ledger.lost(self._device[m.rank]):
                raise GpuLost(m.rank, phase)

    # -- start-up -----------------------------------------------------------------------------

    def start_other_processes(self) -> None:
        """The container's other processes that touch a GPU (the API server on cuda:0, ...).

        They start before the workers, so the workers' memory snapshot sees them as used by
        other processes: the start-up check counts them, vLLM's KV budget does not.
        """
        for m in self.ranks:
            for name, nbytes in m.others:
                self.ledger.start_other(self._device[m.rank], name, nbytes)

    def init_devices(self) -> None:
        """CUDA context, NCCL communicators, custom all-reduce and NVLS buffers."""
        for m in self.ranks:
            self._allocate(m.rank, TAG_INIT, m.init, "init-device")

    def check_free_memory(self) -> list[int]:
        """requested = ceil(total × utilisation); vLLM refuses to start if free is below it.

        The check runs even when --kv-cache-memory-bytes is given (init_device always calls
        it), so a pinned budget also needs a utilisation the free memory can satisfy.
        """
        self.snapshot_free = [self.ledger.free(self._device[m.rank]) for m in self.ranks]
        return self.check_requested()

    def check_requested(self) -> list[int]:
        """The check against the snapshot taken (vLLM 0.34 runs it again on falling back)."""
        requested = []
        for i, m in enumerate(self.ranks):
            total = self.ledger.total(i)
            want = math.ceil(total * self.config.gpu_memory_utilization)
            free = self.snapshot_free[i]
            if free < want:
                raise StartupFreeMemoryError(
                    m.rank,
                    free=free,
                    total=total,
                    utilization=self.config.gpu_memory_utilization,
                    requested=want,
                    device=i,
                )
            requested.append(want)
        self.requested = requested
        return requested

    def load_weights(self) -> None:
        for m in self.ranks:
            self._allocate(m.rank, TAG_WEIGHTS, m.weights, "load-model")

    def profile(self) -> None:
        """profile_run: a dummy forward at max_num_batched_tokens; its peak is freed again."""
        try:
            for m in self.ranks:
                self._allocate(m.rank, TAG_PROFILE, m.profile_peak, "profile-run")
        finally:
            for m in self.ranks:
                self._release(m.rank, TAG_PROFILE)

    def available_kv(self, requested: Sequence[int]) -> list[int]:
        """What each held rank's worker reports as its available KV memory (`requested` per held
        rank, as check_free_memory returns it)."""
        cfg = self.config
        if cfg.kv_cache_memory_bytes is not None:
            return [cfg.kv_cache_memory_bytes for _ in self.ranks]
        return [
            want - (m.weights + m.profile_peak + m.cuda_graph_estimate)
            for want, m in zip(requested, self.ranks, strict=True)
        ]

    def determine_kv(self, requested: Sequence[int]) -> KVPlan:
        """The plan of a process that holds every rank: `plan_kv` over its own workers' figures."""
        return self.plan_kv(self.available_kv(requested), requested)

    def plan_kv(self, available: Sequence[int], requested: Sequence[int]) -> KVPlan:
        """The engine core's plan from every rank's available KV memory (kv_cache_planning.py).

        vLLM 0.33 reserves the null block before its checks: each worker's memory minus one
        block's bytes (all its layers' pages) must hold one max_model_len request
        (check_enough_kv_cache_memory), and `--max-model-len auto` fits the length to that
        same memory. The pool itself is allocated from the full memory (num_blocks =
        available // block bytes, the minimum over workers).
        """
        cfg = self.config
        pinned = cfg.kv_cache_memory_bytes is not None
        ranks = self.all_ranks  # `available` and `requested` are every rank's, in rank order
        nulls = null_blocks()
        check = [avail - nulls * m.block_bytes for avail, m in zip(available, ranks, strict=True)]
        max_model_len = cfg.max_model_len
        if cfg.max_model_len_auto:
            fits = min((c // m.block_bytes) * cfg.block_size for c, m in zip(check, ranks, strict=True))
            if fits <= 0:
                worst = min(range(len(ranks)), key=lambda r: check[r])
                raise NoKVCacheMemory(worst, check[worst], self.kv_hint())
            max_model_len = min(max_model_len, fits)
        per_request = math.ceil(max_model_len / cfg.block_size)
        for m, c in zip(ranks, check, strict=True):
            if c <= 0:
                raise NoKVCacheMemory(m.rank, c, self.kv_hint())
            if per_request * m.block_bytes > c:
                raise KVCacheTooSmall(
                    m.rank,
                    max_model_len=max_model_len,
                    needed=per_request * m.block_bytes,
                    available=c,
                    estimated=min(max_model_len, (c // m.block_bytes) * cfg.block_size),
                    hint=self.kv_hint(),
                )
        blocks = [avail // m.block_bytes for avail, m in zip(available, ranks, strict=True)]
        num_blocks = min(blocks)
        self.plan = KVPlan(
            available=tuple(available),
            requested=tuple(requested),
            num_gpu_blocks=num_blocks,
            kv_bytes=tuple(num_blocks * m.block_bytes for m in ranks),
            block_size=cfg.block_size,
            pinned=pinned,
            max_model_len=max_model_len,
            null_blocks=nulls,
        )
        return self.plan

    def kv_hint(self, after_warmup: bool = False) -> str:
        """What vLLM 0.34's too-small messages advise (0.33's carry their own advice)."""
        cfg = self.config
        return kv_memory_hint(cfg.extensible_kv_cache, after_warmup, cfg.gpu_memory_utilization)

    def memory_report(self, rank: int) -> WorkerMemoryReport | None:
        """vLLM's per-worker report after graph capture; None with --kv-cache-memory-bytes.

        gpu_worker.py: consumed = free at the snapshot − free after profiling (the weights
        here: nothing else grows between), peak activation = the profile peak + the CUDA
        graph estimate it subtracted (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, default on),
        the captured graphs; the two suggestions leave a 150 MiB redundancy buffer.
        """
        if self.plan is None or self.plan.pinned:
            return None
        m, i = self.all_ranks[rank], self._device[rank]
        graphs = 0 if self.config.enforce_eager else m.cuda_graph
        estimate = 0 if self.config.enforce_eager else m.cuda_graph_estimate
        peak = m.profile_peak + estimate
        non_kv = m.weights + peak + graphs  # gpu_worker.py:1028-1032: the actual pool here
        return WorkerMemoryReport(
            init_free=self.snapshot_free[i],
            total=self.ledger.total(i),
            utilization=self.config.gpu_memory_utilization,
            requested=self.requested[i],
            total_consumed=m.weights,
            peak_activation=peak,
            cuda_graph=graphs,
            kv_to_requested_limit=int(self.requested[i]) - non_kv - REDUNDANCY_BUFFER_BYTES,
            kv_to_gpu_limit=self.snapshot_free[i] - non_kv - REDUNDANCY_BUFFER_BYTES,
            available_kv=self.plan.available[rank],
        )

    def allocate_kv(self) -> None:
        """The KV cache, after the container's late processes took their memory (they start
        between vLLM's memory snapshot and this allocation, so its budget never saw them)."""
        assert self.plan is not None, "determine_kv first"
        for m in self.ranks:
            for name, nbytes in m.late_others:
                self.ledger.start_other(self._device[m.rank], name, nbytes)
        for m in self.ranks:
            self._allocate(m.rank, TAG_KV, self.plan.kv_bytes[m.rank], "initialize-kv-cache")

    def capture_cuda_graphs(self) -> None:
        for m in self.ranks:
            self._allocate(m.rank, TAG_GRAPHS, m.cuda_graph, "capture-cuda-graphs")

    def warm_up_sampler(self) -> None:
        """The last stage pre-allocates logits for max_num_seqs dummy requests, then frees them."""
        num_reqs = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        try:
            for m in self.ranks:
                self._allocate(m.rank, TAG_TRANSIENT, m.transient(num_reqs), "sampler-warmup")
        except CudaOutOfMemory as oom:
            raise SamplerWarmupOOM(oom, num_reqs) from oom
        finally:
            for m in self.ranks:
                self._release(m.rank, TAG_TRANSIENT)

    # -- serving ------------------------------------------------------------------------------

    def start_serving(self) -> None:
        """The first real forward: communicator memory that profiling never saw appears now."""
        if self.serving_started:
            return
        for m in self.ranks:
            self._allocate(m.rank, TAG_SERVING_COMM, m.serving, "execute-model")
        self.serving_started = True

    def begin_step(self, running_seqs: int) -> None:
        """One decode step's logits for `running_seqs` sequences (held until end_step)."""
        self.start_serving()
        for m in self.ranks:
            if self.ledger.lost(self._device[m.rank]):
                raise GpuLost(m.rank, "execute-model")
            self._allocate(m.rank, TAG_TRANSIENT, m.transient(running_seqs), "execute-model")

    def end_step(self) -> None:
        for m in self.ranks:
            self._release(m.rank, TAG_TRANSIENT)

    def seq_capacity(self) -> int:
        """How many sequences of the load's length the KV cache can hold at once."""
        assert self.plan is not None
        per_seq = math.ceil(self.scenario.load.tokens_per_seq / self.config.block_size)
        return self.plan.usable_blocks // per_seq

    def running_levels(self) -> list[int]:
        """The running batch at each ramp level: demand, capped by max_num_seqs and the KV cache."""
        cap = min(self.config.max_num_seqs, self.seq_capacity())
        return [min(d, cap) for d in self.scenario.load.demand_levels()]

    def startup(self) -> KVPlan:
        """Every start-up phase in vLLM's order (what `outcome()` replays without pauses)."""
        self.start_other_processes()
        self.init_devices()
        requested = self.check_free_memory()
        self.load_weights()
        self.profile()
        plan = self.determine_kv(requested)
        self.allocate_kv()
        if not self.config.enforce_eager:
            self.capture_cuda_graphs()
        self.warm_up_sampler()
        return plan
