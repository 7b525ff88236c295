"""vLLM 0.34's start-up and serving with the extensible KV cache, over the same ledger as 0.33's.

The order (vllm/v1/engine/core.py `_initialize_kv_caches`, vllm/v1/worker/gpu_worker.py):

1. init_device takes the memory snapshot; requested = ceil(total × the resolved utilisation),
   1.0 when unset, and free below it is no refusal in this mode (vllm/v1/worker/utils.py
   `request_memory`: the budget is only a cap on the address range).
2. The weights; the profile run sizes the reserved capacity exactly as 0.33 sized the cache
   ("Available KV cache memory", the capacity checks of get_kv_cache_configs).
3. initialize_from_config reserves the range and commits the null block (`MIN_COMMITTED_BLOCKS`).
4. compile_or_warm_up_model: warm-up and the sizing steps (`warm_up`: real steps through the
   worker's execute_model, so the communicator memory 0.33 first met serving appears here, and
   the step's peak: the profiled activation peak, with the CUDA graph estimate vLLM folds into
   it), CUDA graph capture, the sampler warm-up; then each worker measures
   (`extensible_kv.measure_kv_cache_blocks`) and caps torch.
5. The engine core takes the minimum of every worker's blocks, across nodes too, at most the
   capacity (kv_cache_planning.finalize_extensible_kv_cache), refits an auto length, checks one
   max_model_len request still fits (shrink_kv_cache_configs), and the workers commit it
   (extend_kv_cache).

While serving, torch's reservation (weights, graphs, the step's transients) is held under the cap:
an allocation past it fails inside torch (`TorchCapOOM`), whatever the GPU has free; one past
what the GPU has free (a neighbour grew into the margin) fails as on any GPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rankguard_sim.physics.engine_config import EngineConfig
from rankguard_sim.physics.engine_failures import (
    CudaOutOfMemory,
    KVCacheTooSmall,
    NoKVCacheMemory,
    TorchCapOOM,
)
from rankguard_sim.physics.engine_memory import (
    ALL_TAGS,
    TAG_GRAPHS,
    TAG_KV,
    TAG_PROFILE,
    TAG_SERVING_COMM,
    TAG_TRANSIENT,
    TAG_WEIGHTS,
    EngineMemoryModel,
    KVPlan,
    Ledger,
    RankMemory,
)
from rankguard_sim.physics.extensible_kv import ExtensibleFacts, WarmupMeasurement, measure_kv_cache_blocks
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.vllm_snapshot import extensible_facts

# ExtensibleKVCache.min_committed_blocks for a layer-outermost layout: the null block
MIN_COMMITTED_BLOCKS = 1
# What torch's caching allocator holds (the KV cache is driver-mapped, outside it)
TORCH_TAGS = (TAG_WEIGHTS, TAG_PROFILE, TAG_TRANSIENT, TAG_GRAPHS)
PHASE_EXTEND = "extend-kv-cache"
PHASE_WARMUP = "warmup"


class MeasuredEngineModel(EngineMemoryModel):
    """EngineMemoryModel with 0.34's extensible KV cache (the mode resolved on)."""

    def __init__(
        self,
        scenario: Scenario,
        config: EngineConfig,
        ledger: Ledger,
        ranks: Sequence[int] | None = None,
        *,
        facts: ExtensibleFacts,
    ) -> None:
        super().__init__(scenario, config, ledger, ranks)
        self.facts = facts
        self.torch_caps: dict[int, int] = {}  # ledger GPU -> the cap on torch's reservation
        self.measurements: list[WarmupMeasurement] = []

    # -- start-up -----------------------------------------------------------------------------

    def check_free_memory(self) -> list[int]:
        """requested = ceil(total × utilisation), without 0.33's refusal (a cap, not a need)."""
        self.snapshot_free = [self.ledger.free(self._device[m.rank]) for m in self.ranks]
        util = self.config.gpu_memory_utilization
        self.requested = [math.ceil(self.ledger.total(i) * util) for i in range(len(self.ranks))]
        return self.requested

    def allocate_kv(self) -> None:
        """Reserve the range (no memory) and commit the null block; late processes start first,
        as in 0.33's order."""
        assert self.plan is not None, "determine_kv first"
        for m in self.ranks:
            for name, nbytes in m.late_others:
                self.ledger.start_other(self._device[m.rank], name, nbytes)
        for m in self.ranks:
            self._allocate(m.rank, TAG_KV, MIN_COMMITTED_BLOCKS * m.block_bytes, "initialize-kv-cache")

    def warm_up(self) -> None:
        """warmup_kernels and run_kv_cache_sizing_warmup: full steps through the serving path
        (its communicators appear) whose transient peak is freed again."""
        for m in self.ranks:
            self._allocate(m.rank, TAG_SERVING_COMM, m.serving, PHASE_WARMUP)
        self.serving_started = True
        try:
            for m in self.ranks:
                self._allocate(m.rank, TAG_TRANSIENT, m.profile_peak, PHASE_WARMUP)
        finally:
            for m in self.ranks:
                self._release(m.rank, TAG_TRANSIENT)

    def transient_peak(self, m: RankMemory) -> int:
        """reserved_headroom_bytes: the profiled activation peak plus the CUDA graph estimate
        (peak_activation_memory), which the sizing steps' own peak does not exceed here."""
        return m.profile_peak + (0 if self.config.enforce_eager else m.cuda_graph_estimate)

    def torch_reserved(self, dev: int) -> int:
        return sum(self.ledger.held(dev, t) for t in TORCH_TAGS)

    def measure(self) -> list[WarmupMeasurement]:
        """Each held rank's measurement after warm-up; caps torch on its GPU."""
        assert self.plan is not None, "determine_kv first"
        util = self.config.explicit_utilization
        out = []
        for m in self.ranks:
            dev = self._device[m.rank]
            found = measure_kv_cache_blocks(
                self.facts,
                rank=m.rank,
                init_free=self.snapshot_free[dev],
                free=self.ledger.free(dev),
                committed=self.ledger.held(dev, TAG_KV),
                requested=self.requested[dev],
                transient_peak=self.transient_peak(m),
                torch_growth=m.profile_peak,  # a sizing step's reservation growth: its peak
                torch_reserved=self.torch_reserved(dev),
                block_bytes=m.block_bytes,
                capacity_blocks=self.plan.num_gpu_blocks,
                utilization=util,
            )
            self.torch_caps[dev] = found.torch_cap_bytes
            out.append(found)
        self.measurements = out
        return out

    def finalize(self, blocks: Sequence[int]) -> KVPlan:
        """The engine core's settlement from every rank's measured blocks (the whole world's)."""
        plan, cfg = self.plan, self.config
        assert plan is not None, "determine_kv first"
        num = min(*blocks, plan.num_gpu_blocks)
        usable = num - plan.null_blocks  # BlockPool holds the null block back
        hint = self.kv_hint(after_warmup=True)
        max_model_len = plan.max_model_len
        if cfg.max_model_len_auto:
            fits = usable * cfg.block_size
            if fits <= 0:
                raise NoKVCacheMemory(self.all_ranks[0].rank, usable * self.all_ranks[0].block_bytes, hint)
            max_model_len = min(cfg.max_model_len, fits)
        per_request = math.ceil(max_model_len / cfg.block_size)
        for m in self.all_ranks:
            available = usable * m.block_bytes
            if available <= 0:
                raise NoKVCacheMemory(m.rank, available, hint)
            if per_request * m.block_bytes > available:
                raise KVCacheTooSmall(
                    m.rank,
                    max_model_len=max_model_len,
                    needed=per_request * m.block_bytes,
                    available=available,
                    estimated=usable * cfg.block_size,
                    hint=hint,
                )
        self.plan = dataclasses.replace(
            plan,
            num_gpu_blocks=num,
            kv_bytes=tuple(num * m.block_bytes for m in self.all_ranks),
            max_model_len=max_model_len,
        )
        return self.plan

    def extend(self) -> None:
        """Commit the settled blocks (a driver allocation outside torch, beside what is free)."""
        assert self.plan is not None
        for m in self.ranks:
            dev = self._device[m.rank]
            target, held = self.plan.kv_bytes[m.rank], self.ledger.held(dev, TAG_KV)
            if target > held:
                self._allocate(m.rank, TAG_KV, target - held, PHASE_EXTEND)
            else:
                self.ledger.hold(dev, TAG_KV, target)

    # -- allocation under torch's cap ---------------------------------------------------------

    def _allocate(self, rank: int, tag: str, nbytes: int, phase: str) -> None:
        dev = self._device[rank]
        cap = self.torch_caps.get(dev)
        if cap is not None and tag in TORCH_TAGS and nbytes > 0 and self.torch_reserved(dev) + nbytes > cap:
            held = {t: self.ledger.held(dev, t) for t in ALL_TAGS}
            oom = CudaOutOfMemory(
                rank,
                phase,
                nbytes=nbytes,
                free=self.ledger.free(dev),
                total=self.ledger.total(dev),
                process_bytes=sum(held.values()),
                torch_allocated=self.torch_reserved(dev),
                private_pools=held[TAG_GRAPHS],
                others=self.ledger.others(dev),
                what=tag,
                device=dev,
            )
            raise TorchCapOOM(oom, cap)
        super()._allocate(rank, tag, nbytes, phase)

    def startup(self) -> KVPlan:
        """Every start-up phase in 0.34's order (what `outcome()` replays without pauses)."""
        self.start_other_processes()
        self.init_devices()
        requested = self.check_free_memory()
        self.load_weights()
        self.profile()
        self.determine_kv(requested)
        self.allocate_kv()
        self.warm_up()
        if not self.config.enforce_eager:
            self.capture_cuda_graphs()
        self.warm_up_sampler()
        plan = self.finalize([found.blocks for found in self.measure()])
        self.extend()
        return plan


def engine_model(
    scenario: Scenario, config: EngineConfig, ledger: Ledger, ranks: Sequence[int] | None = None
) -> EngineMemoryModel:
    """The engine the played release runs for `config`: 0.34's measured sizing when its mode is
    on, else the estimate-based sequence."""
    facts = extensible_facts()
    if not config.extensible_kv_cache or facts is None:
        return EngineMemoryModel(scenario, config, ledger, ranks)
    return MeasuredEngineModel(scenario, config, ledger, ranks, facts=ExtensibleFacts.from_engine(facts))
