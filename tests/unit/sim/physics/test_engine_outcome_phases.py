"""The phase scenarios (issue 27): each OOM comes from its phase's memory, and only the right lever
fixes it. Asked of the world's own pure outcome (`engine_outcome.outcome`), which is what the fake
vLLM runs; the figures a lever is given are the ones rankguard would read off the first OOM."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from rankguard_sim.fake_vllm.args import engine_config_from_argv
from rankguard_sim.physics.engine_config import EngineConfigError, cudagraph_capture_sizes, engine_config
from rankguard_sim.physics.engine_memory import rank_memory
from rankguard_sim.physics.engine_outcome import Outcome, outcome
from rankguard_sim.physics.scenario_data import GIB, MIB, ScenarioError
from rankguard_sim.physics.scenario_file import builtin_dir, load_scenario, parse_scenario

MARGIN = 512 * MIB  # rankguard's default spec.memory.safetyMarginBytes
CUDA_GRAPH_KV_FLOOR = 4.5 * GIB  # the spec.remediation.minKVCacheBytes the oom-cuda-graphs services set


def kv_cut(o: Outcome) -> int:
    """The KV budget rankguard's rule gives after this OOM: the KV in effect, less the deficit and margin."""
    assert o.requested_bytes is not None and o.free_bytes is not None
    return o.kv_bytes_per_rank - (o.requested_bytes - o.free_bytes) - MARGIN


def test_capture_sizes_follow_vllm_0_33s_defaults() -> None:
    default = cudagraph_capture_sizes(256, 8192, None)
    assert default[:5] == (1, 2, 4, 8, 16) and default[-3:] == (480, 496, 512) and len(default) == 51
    assert cudagraph_capture_sizes(8, 8192, None) == (1, 2, 4, 8, 16)  # min(2 x 8, 512)
    assert cudagraph_capture_sizes(256, 300, None)[-1] == 300  # capped at the batched tokens (captured)
    assert cudagraph_capture_sizes(256, 8192, 100)[-1] == 96  # the flag truncated to the list's last size
    with pytest.raises(EngineConfigError, match="greater than or equal to 1"):
        cudagraph_capture_sizes(256, 8192, 0)


def test_the_flag_is_read_and_the_pool_grows_with_the_capture_size() -> None:
    s = load_scenario("oom-cuda-graphs")
    argv = ["serve", s.model.name, "--max-cudagraph-capture-size", "256"]
    config = engine_config_from_argv(s, argv, env={})
    assert config.max_cudagraph_capture_size == 256
    assert engine_config(s).max_cudagraph_capture_size == 512
    assert engine_config(s, enforce_eager=True).max_cudagraph_capture_size == 0
    [full] = rank_memory(s, engine_config(s))
    [half] = rank_memory(s, config)
    [eager] = rank_memory(s, engine_config(s, enforce_eager=True))
    assert half.cuda_graph * 2 == full.cuda_graph and full.cuda_graph_estimate == GIB // 4
    assert (eager.cuda_graph, eager.cuda_graph_estimate) == (0, 0)


def test_weights_that_do_not_fit_fail_in_load_model_under_every_flag() -> None:
    s = load_scenario("oom-weights")
    for flags in (
        {},
        {"kv_cache_memory_bytes": GIB},
        {"gpu_memory_utilization": 0.5},
        {"max_num_seqs": 8, "max_num_batched_tokens": 1024},
        {"max_cudagraph_capture_size": 8},
        {"enforce_eager": True},
    ):
        o = outcome(s, **flags)
        assert (o.crashes, o.phase) == (True, "load-model"), flags


def test_the_profile_run_needs_fewer_batched_tokens_not_less_kv() -> None:
    s = load_scenario("oom-profile")
    o = outcome(s)
    assert (o.crashes, o.phase, o.kv_bytes_per_rank) == (True, "profile-run", 0)
    assert outcome(s, kv_cache_memory_bytes=GIB).phase == "profile-run"  # before any KV cache
    assert outcome(s, max_num_seqs=128).phase == "profile-run"
    assert not outcome(s, max_num_batched_tokens=s.defaults.max_num_batched_tokens // 2).crashes


def test_the_kv_allocation_is_fixed_by_the_kv_budget() -> None:
    s = load_scenario("oom-kv-allocation")
    o = outcome(s)
    assert (o.crashes, o.phase) == (True, "initialize-kv-cache")
    assert outcome(s, max_num_batched_tokens=4096).phase == "initialize-kv-cache"
    fixed = outcome(s, kv_cache_memory_bytes=kv_cut(o))
    assert not fixed.crashes and fixed.peak_running_seqs > 0


def test_graph_capture_needs_a_smaller_capture_size_when_the_kv_cut_would_break_the_floor() -> None:
    s = load_scenario("oom-cuda-graphs")
    o = outcome(s)
    assert (o.crashes, o.phase) == (True, "capture-cuda-graphs")
    assert kv_cut(o) < CUDA_GRAPH_KV_FLOOR  # the cut by the deficit is not allowed
    at_floor = outcome(s, kv_cache_memory_bytes=int(CUDA_GRAPH_KV_FLOOR))
    assert (at_floor.crashes, at_floor.phase) == (True, "capture-cuda-graphs")
    assert not outcome(s, max_cudagraph_capture_size=256).crashes
    assert not outcome(s, enforce_eager=True).crashes


def test_graph_capture_that_only_eager_mode_fixes() -> None:
    s = load_scenario("oom-cuda-graphs-eager")
    assert outcome(s).phase == "capture-cuda-graphs"
    assert outcome(s, kv_cache_memory_bytes=int(CUDA_GRAPH_KV_FLOOR)).phase == "capture-cuda-graphs"
    for size in (256, 128, 64, 32, 16, 8):
        o = outcome(s, max_cudagraph_capture_size=size)
        assert (o.crashes, o.phase) == (True, "capture-cuda-graphs"), size
    assert not outcome(s, enforce_eager=True).crashes


def test_the_sampler_warm_up_is_fixed_by_the_kv_budget() -> None:
    s = load_scenario("oom-sampler-warmup")
    o = outcome(s)
    assert (o.crashes, o.phase, o.reason) == (True, "sampler-warmup", "CUDAOutOfMemory")
    assert o.message is not None and "CUDA out of memory" in o.message
    assert not outcome(s, kv_cache_memory_bytes=kv_cut(o)).crashes


def test_serving_needs_the_kv_cut_then_fewer_sequences() -> None:
    s = load_scenario("oom-serving")
    first = outcome(s)
    assert (first.crashes, first.phase) == (True, "execute-model")
    assert first.running_seqs is not None and first.running_seqs < s.load.peak_running_seqs
    kv = kv_cut(first)
    again = outcome(s, kv_cache_memory_bytes=kv)  # the KV lever alone: the next load level fails
    assert (again.crashes, again.phase) == (True, "execute-model")
    assert again.running_seqs is not None and again.running_seqs > first.running_seqs
    fixed = outcome(s, kv_cache_memory_bytes=kv, max_num_seqs=s.defaults.max_num_seqs // 2)
    assert not fixed.crashes and fixed.peak_running_seqs == s.defaults.max_num_seqs // 2


def _raw(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((builtin_dir() / f"{name}.yaml").read_text())
    assert isinstance(doc, dict)
    return copy.deepcopy(doc)


def test_the_loader_refuses_what_the_new_fields_cannot_mean() -> None:
    doc = _raw("oom-cuda-graphs")
    doc["memory"][0]["profiled"] = False  # the CUDA context has no graph estimate
    with pytest.raises(ScenarioError, match=r"profiled: only a cuda_graph"):
        parse_scenario(doc, where="x.yaml")
    doc = _raw("oom-profile")
    doc["memory"][2]["scales_with"] = "max_cudagraph_capture_size"
    with pytest.raises(ScenarioError, match=r"only CUDA graphs grow"):
        parse_scenario(doc, where="x.yaml")
    doc = _raw("oom-weights")
    doc["topology"]["tensor_parallel_size"] = 2
    doc["memory"][1]["bytes"] = 141107412992 // 2
    with pytest.raises(ScenarioError, match=r"weights_do_not_fit is set, but every rank's weights fit"):
        parse_scenario(doc, where="x.yaml")
