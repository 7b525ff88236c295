"""Scenarios: the loader's validation, the world's per-rank truth, and vLLM's memory replay."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_sim.physics.engine_config import EngineConfigError, engine_config
from rankguard_sim.physics.engine_failures import (
    CUDA_OOM,
    KV_CACHE_TOO_SMALL,
    NO_KV_MEMORY,
    STARTUP_FREE_MEMORY,
    format_size,
    torch_allocation_size,
)
from rankguard_sim.physics.engine_memory import rank_memory
from rankguard_sim.physics.engine_outcome import outcome, true_max_safe_kv
from rankguard_sim.physics.scenario_data import Scenario, ScenarioError, parse_bytes
from rankguard_sim.physics.scenario_file import (
    builtin_dir,
    builtin_names,
    find_scenario,
    load_scenario,
    parse_scenario,
)

GIB = 1 << 30
MIB = 1 << 20
REQUIRED = {"llama3-70b-tp4", "llama3-70b-tp8-nvls", "tp2-pp2", "host-oomkilled"}

# PyTorch's message, as the reference gives it (the fields a recogniser needs).
OOM_RE = re.compile(
    r"^CUDA out of memory\. Tried to allocate (\d+\.\d\d) (MiB|GiB)\. GPU (\d+) has a total capacity "
    r"of (\d+\.\d\d) GiB of which (\d+\.\d\d) (MiB|GiB) is free\. .*Including non-PyTorch memory, "
    r"this process has \d+\.\d\d GiB memory in use\. Of the allocated memory \d+\.\d\d GiB is "
    r"allocated by PyTorch, .*is reserved by PyTorch but unallocated\. If reserved but unallocated "
    r"memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    r"fragmentation\.  See documentation for Memory Management  "
    r"\(https://pytorch\.org/docs/stable/notes/cuda\.html#environment-variables\)$"
)


def raw(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((builtin_dir() / f"{name}.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def block_bytes(s: Scenario, rank: int = 0) -> int:
    return rank_memory(s, engine_config(s))[rank].block_bytes


@pytest.fixture(scope="module")
def tp4() -> Scenario:
    return load_scenario("llama3-70b-tp4")


@pytest.fixture(scope="module")
def tp8() -> Scenario:
    return load_scenario("llama3-70b-tp8-nvls")


@pytest.fixture(scope="module")
def pp() -> Scenario:
    return load_scenario("tp2-pp2")


# -- loading ------------------------------------------------------------------------------------


def test_the_required_scenarios_are_built_in_and_load() -> None:
    assert set(builtin_names()) >= REQUIRED
    for name in builtin_names():
        s = load_scenario(name)
        assert s.name == name
        assert all(len(c.source) > 10 for c in s.components)
        for part in (s.gpu.source, s.model.source, s.defaults.source, s.logits.source, s.load.source):
            assert len(part) > 10


def test_a_path_loads_as_well_as_a_name(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    doc = raw("tp2-pp2")
    doc["name"] = "mine"
    path.write_text(yaml.safe_dump(doc))
    assert load_scenario(str(path)).name == "mine"


def test_unknown_names_list_the_built_ins() -> None:
    with pytest.raises(ScenarioError, match=r"built-ins: .*llama3-70b-tp4"):
        load_scenario("no-such-scenario")


def test_find_scenario_by_model_and_topology() -> None:
    assert find_scenario("meta-llama/Meta-Llama-3-70B-Instruct", 4, 1).name == "llama3-70b-tp4"
    assert find_scenario("/models/Meta-Llama-3-8B-Instruct", 2, 2).name == "tp2-pp2"
    with pytest.raises(ScenarioError, match="no built-in scenario"):
        find_scenario("meta-llama/Meta-Llama-3-70B-Instruct", 2, 1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["memory"][0].pop("source"), r"memory\[0\]\.source: required"),
        (lambda d: d["memory"][0].__setitem__("source", ""), r"every number needs a source"),
        (lambda d: d["memory"][0].__setitem__("bytes", "lots"), r"memory\[0\]\.bytes: expected bytes"),
        (lambda d: d["memory"][0].__setitem__("phase", "later"), r"memory\[0\]\.phase: must be one of"),
        (lambda d: d["memory"][0].__setitem__("ranks", {9: "1GiB"}), r"rank 9 is outside 0\.\.3"),
        (lambda d: d["memory"][0].__setitem__("colour", "red"), r"memory\[0\]: unknown field\(s\) colour"),
        (
            lambda d: d.__setitem__("memory", [m for m in d["memory"] if m["phase"] != "init"]),
            r"needs at least one `init`",
        ),
        (lambda d: d["gpu"].__setitem__("total_bytes", "20GiB"), r"rank 0 needs .* GiB before any KV cache"),
        (
            lambda d: d["engine_defaults"].__setitem__("block_size", 12),
            r"block_size: vLLM 0\.33\.0's default is 16",
        ),
        (lambda d: d["logits"].__setitem__("mode", "scatter"), r"logits\.mode: must be one of"),
        (lambda d: d["topology"].pop("tensor_parallel_size"), r"topology\.tensor_parallel_size: required"),
        (lambda d: d["load"].__setitem__("ramp_levels", 0), r"load\.ramp_levels: must be >= 1"),
    ],
)
def test_validation_says_where_and_what(mutate: Any, message: str) -> None:
    doc = copy.deepcopy(raw("llama3-70b-tp4"))
    mutate(doc)
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(doc, where="x.yaml")


def test_broken_yaml_is_reported_with_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match=r"broken\.yaml: not valid YAML"):
        load_scenario(path)


def test_sizes_parse_with_binary_and_decimal_units() -> None:
    assert parse_bytes("575MiB") == 575 * MIB
    assert parse_bytes("1.5 GiB") == 3 * GIB // 2
    assert parse_bytes("2GB") == 2_000_000_000
    assert parse_bytes(1234) == 1234
    for bad in (-1, "1 GiBs", True, "x"):
        with pytest.raises(ScenarioError):
            parse_bytes(bad)


# -- the world's per-rank truth ------------------------------------------------------------------


def test_tp4_rank0_skew_is_the_extra_cuda_contexts_on_gpu0_and_logits_are_all_gathered(
    tp4: Scenario,
) -> None:
    """vLLM v1: symmetric workers, logits all-gathered; GPU 0 also hosts other processes."""
    assert tp4.logits.mode == "all_gather"
    ranks = rank_memory(tp4, engine_config(tp4))
    # The workers' own memory is identical on every rank (public H100 start-up logs)...
    worker = [(m.init, m.weights, m.profile_peak, m.cuda_graph, m.serving, m.logits_per_seq) for m in ranks]
    assert len(set(worker)) == 1
    assert {m.logits_per_seq for m in ranks} == {128256 * 4}  # full vocabulary on every TP rank
    # ...and the whole skew is the container's other processes on cuda:0, before the snapshot.
    assert [m.other_bytes for m in ranks][1:] == [0, 0, 0] and ranks[0].other_bytes > 0
    assert {c.phase for c in tp4.components if c.phase == "other_process"} == {"other_process"}
    assert 1e9 <= ranks[0].other_bytes <= 2e9  # "GPU 0's memory usage is 1–2 GB higher than GPUs 1–3"
    assert tp4.comm_init_bytes(0) == tp4.comm_init_bytes(1)  # the probe's cost: not the skew
    assert ranks[0].kv_bytes_per_token == 327680 // 4  # the reference's TP1 figure over TP4


def test_tp8_has_nvls_buffers_and_every_rank_holds_full_logits(tp8: Scenario) -> None:
    nvls = [c for c in tp8.components if "nvls" in c.name]
    assert nvls and nvls[0].default_bytes == 288 * MIB and nvls[0].phase == "init"
    ranks = rank_memory(tp8, engine_config(tp8))
    assert {m.logits_per_seq for m in ranks} == {128256 * 4}
    assert ranks[0].kv_bytes_per_token == 40960
    assert all(tp8.comm_init_bytes(r) > 288 * MIB for r in range(8))


def test_pp_terminal_ranks_hold_logits_and_the_heavy_communicators(pp: Scenario) -> None:
    ranks = rank_memory(pp, engine_config(pp))
    assert [m.logits_per_seq > 0 for m in ranks] == [False, False, True, True]
    nccl = [m.init - pp.phase_bytes(m.rank, "init") + m.serving for m in ranks]  # serving-time comm
    assert nccl[2] > nccl[0]
    total_terminal = (
        ranks[2].serving + pp.phase_bytes(2, "init") - parse_bytes("575MiB") - parse_bytes("24MiB")
    )
    assert total_terminal == pytest.approx(8.76 * GIB, rel=0.001)  # PR #45517's figure
    assert ranks[0].kv_bytes_per_token == 16 * 2 * 4 * 128 * 2  # 16 of 32 layers, 4 of 8 KV heads


def test_uneven_layers_go_to_the_stages_before_the_last() -> None:
    doc = raw("tp2-pp2")
    doc["model"]["num_layers"] = 33
    doc["topology"]["pipeline_parallel_size"] = 3
    doc["topology"]["tensor_parallel_size"] = 1
    doc["memory"] = [m for m in doc["memory"] if "ranks" not in m]
    s = parse_scenario(doc)
    assert [s.layers_on_stage(i) for i in range(3)] == [11, 11, 11]
    doc["model"]["num_layers"] = 35
    s = parse_scenario(doc)
    assert [s.layers_on_stage(i) for i in range(3)] == [12, 12, 11]


def test_flags_change_the_world_as_vllm_would(tp4: Scenario) -> None:
    base = rank_memory(tp4, engine_config(tp4))[0]
    eager = rank_memory(tp4, engine_config(tp4, enforce_eager=True))[0]
    fp8 = rank_memory(tp4, engine_config(tp4, kv_cache_dtype="fp8"))[0]
    fp32 = rank_memory(tp4, engine_config(tp4, dtype="float32"))[0]
    no_car = rank_memory(tp4, engine_config(tp4, disable_custom_all_reduce=True))[0]
    tokens = rank_memory(tp4, engine_config(tp4, max_num_batched_tokens=4096))[0]
    assert (base.cuda_graph > 0, eager.cuda_graph) == (True, 0)
    assert fp8.kv_bytes_per_token * 2 == base.kv_bytes_per_token
    assert fp32.weights == 2 * base.weights
    assert base.init - no_car.init == 24 * MIB
    assert tokens.profile_peak == 2 * base.profile_peak


def test_engine_config_refuses_what_vllm_refuses(tp4: Scenario) -> None:
    with pytest.raises(EngineConfigError, match=r"TP4×PP1.*TP2×PP1"):
        engine_config(tp4, tensor_parallel_size=2)
    with pytest.raises(EngineConfigError, match=r"max_model_len \(16384\) is greater than the derived"):
        engine_config(tp4, max_model_len=16384)
    assert engine_config(tp4, max_model_len=16384, allow_long_max_model_len=True).max_model_len == 16384
    for kwargs in (
        {"gpu_memory_utilization": 1.2},
        {"gpu_memory_utilization": 0.0},
        {"dtype": "int3"},
        {"block_size": 0},
        {"kv_cache_dtype": "fp9"},  # not in vLLM's list (engine.json kv_cache_dtypes)
        {"kv_cache_dtype": "nvfp4"},  # vLLM's, but the world cannot size it
    ):
        with pytest.raises(EngineConfigError):
            engine_config(tp4, **kwargs)


# -- vLLM's replay: outcome() -------------------------------------------------------------------


def test_tp4_default_utilisation_crashes_rank0_under_load_and_one_drop_is_stable(tp4: Scenario) -> None:
    crash = outcome(tp4)
    assert crash.crashes and crash.rank == 0 and crash.reason == CUDA_OOM
    assert crash.phase == "execute-model" and crash.running_seqs is not None
    assert 0 < crash.running_seqs <= tp4.defaults.max_num_seqs  # under load, not at start-up
    assert crash.message is not None and OOM_RE.match(crash.message)
    assert crash.free_bytes is not None and crash.requested_bytes is not None
    assert crash.message.startswith(
        f"CUDA out of memory. Tried to allocate {crash.requested_bytes / MIB:.2f} MiB. GPU 0 "
    )
    assert crash.free_bytes < crash.requested_bytes
    stable = outcome(tp4, gpu_memory_utilization=0.87)
    assert not stable.crashes and stable.peak_running_seqs == 256
    assert stable.kv_bytes_per_rank < crash.kv_bytes_per_rank


def test_pp_crashes_on_a_pipeline_terminal_rank_never_rank0(pp: Scenario) -> None:
    for util in (0.92, 0.85, 0.75):
        result = outcome(pp, gpu_memory_utilization=util)
        assert result.crashes and result.rank in (2, 3), util
    safe = true_max_safe_kv(pp)
    assert safe.bottleneck_rank in (2, 3)
    assert safe.headroom_per_rank[0] > safe.headroom_per_rank[2] + 5 * GIB


def test_tp8_default_crashes_rank0(tp8: Scenario) -> None:
    result = outcome(tp8)
    assert (result.crashes, result.rank, result.reason) == (True, 0, CUDA_OOM)


def test_host_oomkilled_is_comfortable_on_the_gpu_but_not_in_host_memory() -> None:
    s = load_scenario("host-oomkilled")
    assert not outcome(s).crashes
    assert s.host_memory is not None
    assert s.host_memory.baseline_bytes < 16 * GIB < s.host_memory.after_load_bytes < 24 * GIB


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_the_true_maximum_is_exactly_the_edge(name: str) -> None:
    """A pinned budget of the true maximum never crashes; one block more crashes its bottleneck."""
    s = load_scenario(name)
    safe = true_max_safe_kv(s)
    bb = block_bytes(s, safe.bottleneck_rank)
    at_edge = outcome(s, kv_cache_memory_bytes=safe.num_gpu_blocks * bb)
    assert not at_edge.crashes
    assert at_edge.num_gpu_blocks == safe.num_gpu_blocks
    over = outcome(s, kv_cache_memory_bytes=(safe.num_gpu_blocks + 1) * bb)
    assert over.crashes and over.rank == safe.bottleneck_rank and over.reason == CUDA_OOM


def test_kv_bytes_kept_by_utilisation_are_measured_against_the_true_maximum(tp4: Scenario) -> None:
    safe = true_max_safe_kv(tp4)
    kept = [outcome(tp4, gpu_memory_utilization=u).num_gpu_blocks / safe.num_gpu_blocks for u in (0.87, 0.82)]
    assert 0.85 < kept[0] < 0.95 and kept[1] < kept[0]  # each 0.05 drop throws away ~4 GiB per GPU


def test_startup_check_fails_on_the_rank_with_too_little_free_memory(tp4: Scenario) -> None:
    others = [0, 0, 20 * GIB, 0]  # another process holds 20 GiB on GPU 2
    result = outcome(tp4, other_used_bytes=others)
    assert (result.crashes, result.rank, result.reason) == (True, 2, STARTUP_FREE_MEMORY)
    assert result.message is not None
    assert re.match(
        r"Free memory on device cuda:2 \(\d+\.\d\d/79\.14 GiB\) on startup is less than desired GPU memory "
        r"utilization \(0\.92, 72\.81 GiB\)\. Decrease GPU memory utilization",
        result.message,
    )
    # The same check applies with a pinned budget: vLLM's init_device always runs it.
    pinned = outcome(tp4, kv_cache_memory_bytes=GIB, other_used_bytes=others)
    assert pinned.reason == STARTUP_FREE_MEMORY
    # With a utilisation the free memory allows, a budget that fits next to the stranger runs...
    assert not outcome(
        tp4, kv_cache_memory_bytes=20 * GIB, gpu_memory_utilization=0.5, other_used_bytes=others
    ).crashes
    # ...and one that does not fit runs GPU 2 out of memory when the KV cache is allocated.
    big = outcome(tp4, kv_cache_memory_bytes=30 * GIB, gpu_memory_utilization=0.5, other_used_bytes=others)
    assert (big.rank, big.phase) == (2, "initialize-kv-cache")
    assert big.message is not None and "Process 0 has 20.00 GiB memory in use." in big.message


def test_a_budget_below_one_request_is_refused_with_vllms_estimate(tp4: Scenario) -> None:
    result = outcome(tp4, kv_cache_memory_bytes=300 * MIB)
    assert result.reason == KV_CACHE_TOO_SMALL and result.rank == 0
    # 300 MiB / (16 tokens × 81,920 B) = 240 blocks, one is the null block → 239 × 16 tokens
    assert result.message is not None and "the estimated maximum model length is 3824." in result.message
    assert "max seq len (8192), (0.62 GiB KV cache is needed" in result.message
    no_room = outcome(tp4, gpu_memory_utilization=0.3)
    assert no_room.reason == NO_KV_MEMORY


def test_an_oversized_pinned_budget_fails_when_the_kv_cache_is_allocated(tp4: Scenario) -> None:
    result = outcome(tp4, kv_cache_memory_bytes=60 * GIB)
    assert result.crashes and result.phase == "initialize-kv-cache" and result.rank == 0
    assert result.running_seqs is None


def test_max_num_seqs_bounds_the_peak_and_the_warm_up() -> None:
    s = load_scenario("host-oomkilled")
    small = true_max_safe_kv(s, max_num_seqs=64)
    large = true_max_safe_kv(s)
    assert small.peak_running_seqs == 64 and small.kv_bytes > large.kv_bytes


def test_torch_size_formatting_matches_c10() -> None:
    assert format_size(1024) == "1024 bytes"
    assert format_size(1025) == "1.00 KiB"
    assert format_size(MIB) == "1024.00 KiB"
    assert format_size(GIB) == "1024.00 MiB"
    assert format_size(3 * GIB // 2) == "1.50 GiB"
    assert torch_allocation_size(100) == 2 * MIB
    assert torch_allocation_size(5 * MIB) == 20 * MIB
    assert torch_allocation_size(98_500_608) == 94 * MIB  # 192 × 513,024 rounded up to 2 MiB
