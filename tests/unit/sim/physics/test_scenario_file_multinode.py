"""The world of a multi-node group: the TP8×PP2 two-node scenario's per-rank truth, scenarios
matched by their nodes too, and vLLM's memory replayed one node at a time (each node its own
ranks on its own GPUs) agreeing with the replay of the whole world."""

from __future__ import annotations

import copy
import math

import pytest
import yaml

from rankguard_sim.physics.engine_config import EngineConfigError, engine_config
from rankguard_sim.physics.engine_failures import CudaOutOfMemory
from rankguard_sim.physics.engine_memory import EngineMemoryModel, PureLedger, rank_memory
from rankguard_sim.physics.engine_outcome import outcome, true_max_safe_kv
from rankguard_sim.physics.scenario_data import GIB, ScenarioError
from rankguard_sim.physics.scenario_file import builtin_dir, find_scenario, load_scenario, parse_scenario

SCENARIO = "llama3-70b-tp8-pp2-2nodes"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"


def test_the_two_node_scenario_is_matched_by_model_topology_and_nodes() -> None:
    s = load_scenario(SCENARIO)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size, s.nnodes, s.local_world_size) == (8, 2, 2, 8)
    assert list(s.node_ranks(1)) == list(range(8, 16))
    assert find_scenario(MODEL, 8, 2, 2).name == SCENARIO
    assert find_scenario("/models/Llama-3.1-70B-Instruct", 8, 2, nnodes=2).name == SCENARIO
    with pytest.raises(ScenarioError, match=r"TP8×PP2; set"):
        find_scenario(MODEL, 8, 2)  # one node: no measurements
    with pytest.raises(ScenarioError, match=r"over 2 nodes"):
        find_scenario("meta-llama/Meta-Llama-3-70B-Instruct", 8, 1, 2)
    with pytest.raises(EngineConfigError, match="over 2 node"):
        engine_config(s, nnodes=1)
    assert load_scenario("tp2-pp2").nnodes == 1


def test_a_world_its_nodes_cannot_split_evenly_is_refused() -> None:
    doc = yaml.safe_load((builtin_dir() / f"{SCENARIO}.yaml").read_text())
    bad = copy.deepcopy(doc)
    bad["topology"]["nnodes"] = 3
    with pytest.raises(ScenarioError, match="3 nodes cannot split a world of 16 ranks"):
        parse_scenario(bad)


def test_the_bottleneck_is_node_1s_last_pipeline_stage_not_rank_0() -> None:
    s = load_scenario(SCENARIO)
    safe = true_max_safe_kv(s)
    room = safe.headroom_per_rank
    assert safe.bottleneck_rank == 8
    assert len(set(room[8:])) == 1 and len(set(room[1:8])) == 1  # each stage's TP ranks alike
    assert room[8] < room[0] < room[1]  # stage 1 (node 1) < rank 0 (the API server's GPU) < the rest
    assert round(room[8] / GIB, 2) == 62.81 and round(room[0] / GIB, 2) == 63.66
    assert round(room[1] / GIB, 2) == 65.15
    crash = outcome(s)  # vLLM's default utilisation: rank 8 runs out once ~600 sequences run
    assert crash.crashes and crash.rank == 8 and crash.phase == "execute-model"
    assert crash.running_seqs is not None and 500 <= crash.running_seqs <= 700
    assert not outcome(s, gpu_memory_utilization=0.88).crashes


def test_the_last_stage_profiles_the_dummy_sampler_for_max_num_seqs_requests() -> None:
    s = load_scenario(SCENARIO)
    default = rank_memory(s, engine_config(s))
    fewer = rank_memory(s, engine_config(s, max_num_seqs=256))
    logits = 1024 * 128256 * 4
    assert default[8].profile_peak - default[7].profile_peak == logits
    assert fewer[8].profile_peak - fewer[7].profile_peak == logits // 4


def test_each_node_replays_its_own_ranks_as_the_whole_world_would() -> None:
    s = load_scenario(SCENARIO)
    config = engine_config(s, gpu_memory_utilization=0.88)
    whole = EngineMemoryModel(s, config, PureLedger([s.gpu.total_bytes] * 16))
    whole.start_other_processes()
    whole.init_devices()
    requested = whole.check_free_memory()
    nodes = [
        EngineMemoryModel(s, config, PureLedger([s.gpu.total_bytes] * 8), s.node_ranks(n)) for n in (0, 1)
    ]
    node_requested = []
    for node in nodes:
        node.start_other_processes()
        node.init_devices()
        node_requested += node.check_free_memory()
    assert node_requested == requested
    assert [m.rank for m in nodes[1].ranks] == list(range(8, 16)) and nodes[1].device(8) == 0
    # the leader plans from every node's figures, as the whole world's engine core does
    available = nodes[0].available_kv(requested[:8]) + nodes[1].available_kv(requested[8:])
    plan = nodes[0].plan_kv(available, requested)
    assert plan == whole.determine_kv(requested)
    assert min(available[8:]) < min(available[:8])  # the minimum is node 1's
    assert plan.num_gpu_blocks == min(available[8:]) // whole.all_ranks[8].block_bytes
    for node in nodes:
        node.plan = plan
        node.load_weights()
        node.allocate_kv()
    report = nodes[1].memory_report(8)
    whole.load_weights()
    assert report is not None and report == whole.memory_report(8)


def test_an_oom_names_the_nodes_own_gpu_and_the_global_rank() -> None:
    s = load_scenario(SCENARIO)
    config = engine_config(s)
    node1 = EngineMemoryModel(s, config, PureLedger([s.gpu.total_bytes] * 8), s.node_ranks(1))
    node1.start_other_processes()
    node1.init_devices()
    requested = node1.check_free_memory()
    available = [node1.available_kv(requested)[0]] * 16
    node1.plan = node1.plan_kv(available, [requested[0]] * 16)
    node1.load_weights()
    node1.allocate_kv()
    node1.capture_cuda_graphs()
    with pytest.raises(CudaOutOfMemory) as oom:
        for running in range(1, 1025, 8):
            node1.begin_step(running)
            node1.end_step()
    assert oom.value.rank == 8 and oom.value.device == 0
    assert "GPU 0 has a total capacity of 79.22 GiB" in oom.value.message()
    assert math.isclose(oom.value.total / GIB, 79.22, abs_tol=0.01)
