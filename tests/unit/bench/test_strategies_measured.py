"""bench/strategies_measured.py: vLLM 0.34's world of a case, and what its agent reports.

The checks ask the world's own model (`engine_outcome.outcome` with the extensible KV cache,
under `vllm_snapshot.playing("0.34.0")`) what a run should give, so a bench whose neighbour,
connector or missing VMM did nothing, or whose agent reported the wrong memory as "others",
would fail here.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from rankguard_agent.wire.report import parse_report
from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.physics.engine_outcome import outcome
from rankguard_sim.physics.scenario_data import GIB
from rankguard_sim.physics.scenario_file import load_scenario
from rankguard_sim.vllm_snapshot import playing
from tests import REPO

sys.path.insert(0, str(REPO / "bench"))

import strategies_measured as sm
import strategies_world as world

CASES = {c.name: c for c in sm.CASES}
CLEAN, NEIGHBOUR, CONNECTOR, NO_VMM = (
    CASES["clean-tp4"],
    CASES["neighbour-tp4"],
    CASES["connector-tp4"],
    CASES["no-vmm-tp4"],
)


def _zeros(case: sm.MeasuredCase) -> list[int]:
    return [0] * load_scenario(case.scenario).world_size


def test_vanilla_runs_the_engine_s_own_sizing_with_the_utilisation_unset() -> None:
    argv = sm.vanilla_argv(CLEAN)
    with playing(sm.VERSION):
        assert parse_args(argv).gpu_memory_utilization is None  # 0.34's parser: unset
    run = sm.run_measured(CLEAN, argv, _zeros(CLEAN))
    with playing(sm.VERSION):
        expected = outcome(load_scenario(CLEAN.scenario), extensible_kv_cache=True)
    assert run.engine_measured and not run.crashed
    assert run.outcome.num_gpu_blocks == expected.num_gpu_blocks
    assert run.outcome.kv_tokens == expected.kv_tokens
    # every rank printed its "Memory after warmup" line; the engine took the least of them
    assert len(run.warmup) == load_scenario(CLEAN.scenario).world_size
    assert min(w.blocks for w in run.warmup) == run.outcome.num_gpu_blocks


def test_a_neighbour_that_grows_while_serving_crashes_its_gpu_and_stays_grown() -> None:
    nb = NEIGHBOUR.neighbour
    assert nb is not None
    start = [nb.hold if g == nb.gpu else 0 for g in range(load_scenario(NEIGHBOUR.scenario).world_size)]
    run = sm.run_measured(NEIGHBOUR, sm.vanilla_argv(NEIGHBOUR), start)
    assert run.ready and run.crashed and run.outcome.rank == nb.gpu
    assert run.outcome.phase == "execute-model"
    assert run.others[nb.gpu] == nb.hold  # what the agent saw when the pod turned Ready
    assert run.others_after[nb.gpu] == nb.hold + nb.grow  # the engine let go: it took the rest
    # the next start measures the grown neighbour and survives, as outcome() with it says
    again = sm.run_measured(NEIGHBOUR, sm.vanilla_argv(NEIGHBOUR), run.others_after)
    with playing(sm.VERSION):
        expected = outcome(
            load_scenario(NEIGHBOUR.scenario), extensible_kv_cache=True, other_used_bytes=run.others_after
        )
    assert not again.crashed and again.outcome.num_gpu_blocks == expected.num_gpu_blocks


def test_a_connector_s_buffers_come_after_the_measurement_and_only_with_a_connector() -> None:
    with_connector = sm.run_measured(CONNECTOR, sm.vanilla_argv(CONNECTOR), _zeros(CONNECTOR))
    assert with_connector.crashed and with_connector.outcome.phase == "extend-kv-cache"
    # the measurement itself is the clean one: the buffers were not there yet
    clean = sm.run_measured(CLEAN, sm.vanilla_argv(CLEAN), _zeros(CLEAN))
    assert [w.blocks for w in with_connector.warmup] == [w.blocks for w in clean.warmup]
    assert with_connector.outcome.num_gpu_blocks == clean.outcome.num_gpu_blocks
    # the same case without --kv-transfer-config allocates nothing: it runs as the clean one
    plain = sm.run_measured(CONNECTOR, sm.vanilla_argv(CLEAN), _zeros(CONNECTOR))
    assert not plain.crashed and plain.outcome.num_gpu_blocks == clean.outcome.num_gpu_blocks
    # the true fit's world holds the buffers before the engine measures: it fits around them
    fit = sm.run_measured(CONNECTOR, sm.vanilla_argv(CONNECTOR), _zeros(CONNECTOR), foreseen=True)
    assert not fit.crashed and fit.outcome.num_gpu_blocks < clean.outcome.num_gpu_blocks


def test_without_vmm_the_engine_falls_back_to_its_estimate_at_0_92() -> None:
    run = sm.run_measured(NO_VMM, sm.vanilla_argv(NO_VMM), _zeros(NO_VMM))
    assert run.fell_back and not run.engine_measured and run.warmup == ()
    with playing(sm.VERSION):
        expected = outcome(load_scenario(NO_VMM.scenario), gpu_memory_utilization=0.92)
    assert run.crashed == expected.crashes and run.outcome.rank == expected.rank
    assert run.outcome.num_gpu_blocks == expected.num_gpu_blocks


def test_the_report_names_the_neighbour_as_others_and_never_the_connector() -> None:
    scenario = load_scenario(NEIGHBOUR.scenario)
    nb = NEIGHBOUR.neighbour
    assert nb is not None
    start = [nb.hold if g == nb.gpu else 0 for g in range(scenario.world_size)]
    run = sm.run_measured(NEIGHBOUR, sm.vanilla_argv(NEIGHBOUR), start)
    base = world.agent_report(
        scenario, run.idle_free, run.startup_min_free, 0.0, startup_free=run.startup_free
    )
    report = sm.measured_report(NEIGHBOUR, run, base, run.others)
    assert parse_report(json.dumps(dataclasses.asdict(report)).encode()).dropped_fields == []
    by_rank = {s.rank: s for s in report.ranks}
    assert by_rank[nb.gpu].others_bytes == nb.hold and by_rank[nb.gpu].others[0].bytes == nb.hold
    assert all(by_rank[r].others_bytes == 0 for r in by_rank if r != nb.gpu)
    assert report.vmm is True and report.extensible_disabled is None
    assert all(s.warmup is not None for s in report.ranks)

    c_run = sm.run_measured(CONNECTOR, sm.vanilla_argv(CLEAN), _zeros(CONNECTOR))
    c_base = world.agent_report(scenario, c_run.idle_free, c_run.startup_min_free, 0.0)
    connector = sm.measured_report(CONNECTOR, c_run, c_base, c_run.others)
    assert all(s.others_bytes == 0 and s.others == [] for s in connector.ranks)


def test_the_report_says_when_the_node_lacks_vmm() -> None:
    scenario = load_scenario(NO_VMM.scenario)
    run = sm.run_measured(NO_VMM, sm.vanilla_argv(NO_VMM), _zeros(NO_VMM))
    base = world.agent_report(scenario, run.idle_free, run.startup_min_free, 0.0)
    report = sm.measured_report(NO_VMM, run, base, run.others)
    assert report.vmm is False and report.extensible_disabled
    assert all(s.warmup is None for s in report.ranks)


@pytest.mark.parametrize("case", sm.CASES, ids=lambda c: c.name)
def test_the_0_34_service_leaves_the_block_size_to_the_engine_and_names_its_connector(
    case: sm.MeasuredCase,
) -> None:
    doc = sm.measured_spec(case)
    assert doc["image"] == sm.IMAGE and "blockSize" not in doc["engine"]
    extra = doc["engine"].get("extraArgs", [])
    assert bool(extra) == bool(case.connector_bytes)
    assert (json.dumps(sm.CONNECTOR) in extra) == bool(case.connector_bytes)


def test_the_grown_neighbour_is_what_the_world_gives_back_even_past_the_gpu() -> None:
    # a neighbour cannot hold more than the GPU: what it waits for is capped at the total
    big = dataclasses.replace(NEIGHBOUR, neighbour=sm.Neighbour(gpu=0, hold=2 * GIB, grow=200 * GIB))
    total = load_scenario(big.scenario).gpu.total_bytes
    start = [2 * GIB] + [0] * (load_scenario(big.scenario).world_size - 1)
    run = sm.run_measured(big, sm.vanilla_argv(big), start)
    assert run.crashed and run.others_after[0] == total
