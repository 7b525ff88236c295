"""vLLM 0.34's measured sizing over pure-ledger GPUs: each rank's measurement against the
formula worked by hand from the scenario's bytes, the minimum over ranks, no start-up refusal,
a neighbour at start and one that grows later, torch's cap, and the checks after warm-up."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from rankguard_sim.physics.engine_config import EngineConfig, engine_config
from rankguard_sim.physics.engine_failures import (
    STARTUP_FREE_MEMORY,
    CudaOutOfMemory,
    KVCacheTooSmall,
    NoKVCacheMemory,
    TorchCapOOM,
)
from rankguard_sim.physics.engine_measured import MeasuredEngineModel, engine_model
from rankguard_sim.physics.engine_memory import EngineMemoryModel, PureLedger, RankMemory
from rankguard_sim.physics.engine_outcome import outcome
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.physics.scenario_file import load_scenario
from rankguard_sim.vllm_snapshot import message, playing

GIB = 1 << 30


@pytest.fixture(autouse=True)
def release_034() -> Iterator[None]:
    with playing("0.34.0"):
        yield


@pytest.fixture
def tp4() -> Scenario:
    return load_scenario("llama3-70b-tp4")


def _engine(s: Scenario, others: list[int] | None = None, **flags: object) -> MeasuredEngineModel:
    config = engine_config(s, extensible_kv_cache=True, **flags)  # type: ignore[arg-type]
    engine = engine_model(s, config, PureLedger([s.gpu.total_bytes] * s.world_size, others))
    assert isinstance(engine, MeasuredEngineModel)
    return engine


def _by_hand(s: Scenario, m: RankMemory, config: EngineConfig, neighbour: int = 0) -> int:
    """measure_kv_cache_bytes worked from the scenario's bytes, independently of the ledger."""
    total = s.gpu.total_bytes
    init_free = total - neighbour - m.other_bytes - m.init
    committed = m.block_bytes  # the null block
    free = init_free - m.weights - m.serving - m.cuda_graph - committed
    peak = m.profile_peak + m.cuda_graph_estimate
    non_kv = init_free - free - committed  # weights, serving communicators, graphs
    margin = max(GIB, int(peak * 0.75))
    requested = math.ceil(total * config.gpu_memory_utilization)
    return min(requested - non_kv, free + committed - margin) - max(peak, m.profile_peak)


def test_the_defaults_follow_the_mode(tp4: Scenario) -> None:
    on, off = engine_config(tp4, extensible_kv_cache=True), engine_config(tp4)
    assert (on.gpu_memory_utilization, off.gpu_memory_utilization) == (1.0, 0.92)
    assert on.explicit_utilization is None and on.block_size == 64  # 0.34's default block size
    given = engine_config(tp4, extensible_kv_cache=True, gpu_memory_utilization=0.9)
    assert (given.gpu_memory_utilization, given.explicit_utilization) == (0.9, 0.9)
    assert isinstance(engine_model(tp4, off, PureLedger([1] * 4)), EngineMemoryModel)
    assert not isinstance(engine_model(tp4, off, PureLedger([1] * 4)), MeasuredEngineModel)


def test_each_rank_measures_and_the_world_takes_the_minimum(tp4: Scenario) -> None:
    engine = _engine(tp4)
    plan = engine.startup()
    found = {m.rank: m for m in engine.measurements}
    for m in engine.all_ranks:
        assert found[m.rank].available_bytes == _by_hand(tp4, m, engine.config)
        assert found[m.rank].blocks == found[m.rank].available_bytes // m.block_bytes
    assert plan.num_gpu_blocks == min(m.blocks for m in found.values())
    assert found[0].blocks < found[1].blocks  # rank 0 shares its GPU with the API server
    assert plan.kv_bytes == tuple(plan.num_gpu_blocks * m.block_bytes for m in engine.all_ranks)
    assert all(engine.ledger.held(i, "kv_cache") == plan.kv_bytes[i] for i in range(4))


def test_no_refusal_when_free_is_below_the_request(tp4: Scenario) -> None:
    # utilisation 1.0 asks for the whole GPU; 0.33's check would refuse every rank
    assert outcome(tp4, gpu_memory_utilization=1.0).reason == STARTUP_FREE_MEMORY
    assert not outcome(tp4, extensible_kv_cache=True).crashes


def test_a_neighbour_at_start_shrinks_what_is_measured(tp4: Scenario) -> None:
    clean = _engine(tp4).startup()
    engine = _engine(tp4, others=[0, 6 * GIB, 0, 0])
    crowded = engine.startup()
    m1 = engine.all_ranks[1]
    assert engine.measurements[1].available_bytes == _by_hand(tp4, m1, engine.config, neighbour=6 * GIB)
    assert crowded.num_gpu_blocks == engine.measurements[1].blocks < clean.num_gpu_blocks


def test_a_neighbour_that_grows_after_the_measurement_makes_the_next_step_fail(tp4: Scenario) -> None:
    engine = _engine(tp4)
    engine.startup()
    ledger = engine.ledger
    assert isinstance(ledger, PureLedger)
    engine.begin_step(64)
    engine.end_step()
    ledger.others_used[2] += ledger.free(2)  # it takes all that is free between two steps
    with pytest.raises(CudaOutOfMemory) as failed:
        engine.begin_step(64)
    assert failed.value.rank == 2 and not isinstance(failed.value, TorchCapOOM)
    assert failed.value.free == 0


def test_a_transient_past_torchs_cap_fails_inside_torch(tp4: Scenario) -> None:
    engine = _engine(tp4)
    engine.startup()
    cap = engine.torch_caps[0]
    m = engine.all_ranks[0]
    over = (cap - engine.torch_reserved(0)) // m.transient(1) + 1  # one sequence past the cap
    assert m.transient(over) < engine.ledger.free(0)  # the GPU would have had it
    with pytest.raises(TorchCapOOM) as failed:
        engine.begin_step(over)
    assert failed.value.message().startswith(message("torch_oom_fraction"))
    assert failed.value.phase == "execute-model"
    engine.end_step()
    engine.begin_step(over - 1)  # one fewer fits


def test_the_measured_cache_must_still_hold_one_request(tp4: Scenario) -> None:
    engine = _engine(tp4)
    engine.startup()
    assert engine.plan is not None
    with pytest.raises(KVCacheTooSmall) as small:
        engine.finalize([3] * 4)  # two usable blocks of 64 tokens for 8192
    assert "CUDA graphs and warmup" in small.value.message()  # the after-warm-up advice
    with pytest.raises(NoKVCacheMemory):
        engine.finalize([1] * 4)  # the null block only


def test_an_auto_length_is_refitted_to_the_measured_blocks(tp4: Scenario) -> None:
    engine = _engine(tp4, max_model_len=-1)
    engine.startup()
    assert engine.plan is not None
    refit = engine.finalize([9] * 4)
    assert refit.max_model_len == 8 * 64  # the null block held back


def test_what_torch_holds_at_the_measurement(tp4: Scenario) -> None:
    engine = _engine(tp4)
    engine.startup()
    m = engine.all_ranks[1]
    assert engine.torch_reserved(1) == m.weights + m.cuda_graph
    measured = engine.measurements[1]
    assert measured.peak_bytes == m.profile_peak + m.cuda_graph_estimate
    assert measured.torch_growth_bytes == m.profile_peak


def test_eager_keeps_no_graph_estimate(tp4: Scenario) -> None:
    engine = _engine(tp4, enforce_eager=True)
    engine.startup()
    m = engine.all_ranks[1]
    assert engine.measurements[1].peak_bytes == m.profile_peak
    assert engine.torch_reserved(1) == m.weights  # no graph pool
