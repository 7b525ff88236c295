"""bench/strategies_phases.py: rankguard, the KV-only rule and the by-hand recipe per OOM phase.

Every check asks the world (`rankguard_sim.physics.engine_outcome`, through the bench's own
`run_world`) or the operator's own tables (oom_levers.LADDERS, the budget bounds) what the answer
should be, so a bench that reported the wrong lever, a run that does not serve, or a termination
that lost its phase would fail here.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from rankguard_agent.wire import termination as tm
from rankguard_agent.wire.termination import TerminationMessage
from rankguard_operator.core.budget.bounds import block_unit, kv_floor, prior_plan
from rankguard_operator.core.policy.oom_levers import LADDERS
from rankguard_operator.core.policy.tunables import LEVER_FIELDS, LEVER_KV
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.physics.engine_outcome import true_max_safe_kv
from rankguard_sim.physics.scenario_file import load_scenario
from tests import REPO

sys.path.insert(0, str(REPO / "bench"))

import compare_strategies as cs
import strategies_phases as phases
import strategies_world as world

# The world's name for the step a failure happened in -> the agent's phase for it (the same
# steps: wire/termination.py PHASES, sim/rankguard_sim/fake_vllm/console.py's frames).
AGENT_PHASE = {
    "load-model": tm.PHASE_WEIGHTS,
    "profile-run": tm.PHASE_PROFILE,
    "initialize-kv-cache": tm.PHASE_KV_ALLOCATION,
    "capture-cuda-graphs": tm.PHASE_CUDA_GRAPHS,
    "sampler-warmup": tm.PHASE_SAMPLER_WARMUP,
    "execute-model": tm.PHASE_SERVING,
}
# The flags a run can move, as the fake vLLM's parser names them (the KV budget is two flags).
KV_FIELDS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
LEVER_ARGS = ("max_num_seqs", "max_num_batched_tokens", "max_cudagraph_capture_size", "enforce_eager")


@pytest.fixture(scope="module")
def rows() -> dict[str, phases.PhaseComparison]:
    return {name: phases.compare_phase(name) for name in world.PHASE_SCENARIOS}


def _first(c: phases.PhaseComparison) -> tuple[str, ...]:
    return c.rankguard.argvs[0]


def _changed(first: tuple[str, ...], last: tuple[str, ...]) -> set[str]:
    """The parser's fields that differ between two command lines; the KV budget as one, "kv"."""
    a, b = vars(parse_args(first)), vars(parse_args(last))
    changed = {k for k in LEVER_ARGS if a[k] != b[k]}
    if a["kv_cache_memory_bytes"] != b["kv_cache_memory_bytes"] or (
        b["kv_cache_memory_bytes"] is None and a["gpu_memory_utilization"] != b["gpu_memory_utilization"]
    ):
        changed.add("kv")
    return changed


def test_the_termination_carries_the_phase_the_agent_reads_off_the_engine(
    rows: dict[str, phases.PhaseComparison],
) -> None:
    for name, c in rows.items():
        scenario = load_scenario(name)
        run = world.run_world(scenario, _first(c))
        assert run.crashed
        message = world.termination_message(run, scenario.world_size)
        assert message.reason == tm.CUDA_OOM and message.rank == run.outcome.rank
        assert message.phase == AGENT_PHASE[run.outcome.phase] == c.phase, name
    # a worker of a multi-rank pod: its own log prefix names the rank whose traceback it is
    scenario = load_scenario("tp2-pp2")
    run = world.run_world(scenario, world.utilization_argv(scenario, 0.92))
    message = world.termination_message(run, scenario.world_size)
    assert (message.rank, message.phase) == (run.outcome.rank, AGENT_PHASE[run.outcome.phase])


def test_every_strategy_starts_from_the_same_command_line_at_0_92(
    rows: dict[str, phases.PhaseComparison],
) -> None:
    for c in rows.values():
        first = _first(c)
        assert parse_args(first).gpu_memory_utilization == 0.92
        assert parse_args(first).kv_cache_memory_bytes is None
        assert c.kv_only.argvs[0] == c.by_hand.argvs[0] == first


def test_what_the_table_says_serves_serves_and_what_it_says_stopped_still_crashes(
    rows: dict[str, phases.PhaseComparison],
) -> None:
    for name, c in rows.items():
        scenario = load_scenario(name)
        for r in (*c.results, c.rankguard_planned):
            last = world.run_world(scenario, r.argvs[-1])
            assert last.crashed is (r.outcome != phases.SERVING), (name, r.strategy)
            # every run before the last crashed, or (rankguard's) ran its bottleneck under the
            # low-headroom line, which the operator answers with a roll before an OOM, or served
            # with room that reclaim then grew into (issue 50: a KV-allocation cut leaves the
            # priors' room for what comes after the KV cache, and reclaim takes back what is unused)
            line = parse_spec(phases.phase_spec(scenario)).memory.min_headroom_bytes
            earlier = [world.run_world(scenario, a) for a in r.argvs[:-1]]
            after = [*earlier, last][1:]
            for run, nxt in zip(earlier, after, strict=True):
                under = run.cycle_min_free is not None and min(run.cycle_min_free) < line
                grown = run.outcome.kv_bytes_per_rank < nxt.outcome.kv_bytes_per_rank
                assert run.crashed or (r.strategy == "rankguard" and (under or grown)), (name, r.strategy)
            assert r.crashes >= sum(run.crashed for run in earlier)
            if r.outcome == phases.SERVING:
                config = world.engine_config(scenario, r.argvs[-1])
                assert (r.kv_tokens, r.max_num_seqs) == (last.outcome.kv_tokens, config.max_num_seqs)
                assert r.kv_share is not None and 0 < r.kv_share <= 1.0
            else:
                assert (r.kv_tokens, r.kv_share, r.max_num_seqs) == (0, None, None)
            if r.outcome == phases.NEVER_STABLE:
                assert len(r.argvs) == phases.PHASE_MAX_RUNS


def test_rankguard_moves_only_the_levers_of_the_phase(rows: dict[str, phases.PhaseComparison]) -> None:
    for name, c in rows.items():
        assert c.phase is not None
        allowed = {"kv" if lever == LEVER_KV else LEVER_FIELDS[lever] for lever in LADDERS.get(c.phase, ())}
        moved = _changed(_first(c), c.rankguard.argvs[-1])
        assert moved <= allowed, (name, moved, c.rankguard.trace)
        if c.phase != tm.PHASE_WEIGHTS:
            assert c.rankguard.outcome == phases.SERVING, (name, c.rankguard.trace)
            assert moved, name  # something of the phase's ladder moved to fix it


def test_on_the_profile_run_rankguard_halves_the_batched_tokens_and_kv_only_never_serves(
    rows: dict[str, phases.PhaseComparison],
) -> None:
    c = rows["oom-profile"]
    scenario = load_scenario("oom-profile")
    rg = c.rankguard
    assert rg.outcome == phases.SERVING and rg.crashes_after_first == 0
    assert _changed(_first(c), rg.argvs[-1]) == {"max_num_batched_tokens"}
    before, after = parse_args(_first(c)), parse_args(rg.argvs[-1])
    assert after.max_num_batched_tokens == before.max_num_batched_tokens // 2
    assert (after.kv_cache_memory_bytes, after.gpu_memory_utilization) == (None, 0.92)  # KV untouched
    assert not any(r.outcome == phases.SERVING for r in (c.kv_only, c.by_hand))
    assert _changed(_first(c), c.kv_only.argvs[-1]) == {"kv"}
    # the world agrees: the KV budget KV-only ended at still dies in the profile run
    assert world.run_world(scenario, c.kv_only.argvs[-1]).outcome.phase == "profile-run"


def test_on_the_weights_rankguard_degrades_without_rolling(rows: dict[str, phases.PhaseComparison]) -> None:
    c = rows["oom-weights"]
    rg = c.rankguard
    assert rg.outcome == phases.DEGRADED and rg.why == "WeightsDoNotFit"
    assert len(rg.argvs) == 1 and rg.crashes_after_first == 0 and rg.moved == ()
    assert c.kv_only.outcome != phases.SERVING and c.by_hand.outcome == phases.NEVER_STABLE
    # nothing serves in this world: the true maximum is zero, every last run dies loading weights
    scenario = load_scenario("oom-weights")
    assert true_max_safe_kv(scenario).num_gpu_blocks == 0
    for r in c.results:
        assert world.run_world(scenario, r.argvs[-1]).outcome.phase == "load-model"


def test_kv_only_moves_the_kv_budget_alone_in_whole_blocks_down_to_the_floor(
    rows: dict[str, phases.PhaseComparison],
) -> None:
    for name, c in rows.items():
        scenario = load_scenario(name)
        spec = parse_spec(phases.phase_spec(scenario))
        plan = prior_plan(spec)
        unit, floor = block_unit(plan), kv_floor(spec, plan)
        budgets = []
        for argv in c.kv_only.argvs[1:]:
            assert _changed(_first(c), argv) == {"kv"}, name
            # the same command line but the budget: nothing else is touched
            assert [w for w in argv if w not in _first(c)] == [
                "--kv-cache-memory-bytes",
                str(parse_args(argv).kv_cache_memory_bytes),
            ]
            budgets.append(int(parse_args(argv).kv_cache_memory_bytes))
        assert all(b % unit == 0 and b >= floor for b in budgets), name
        assert budgets == sorted(budgets, reverse=True) and len(set(budgets)) == len(budgets), name
        if c.kv_only.outcome == phases.DEGRADED:
            assert c.kv_only.why.startswith("OOMAtFloor") and budgets[-1] == floor


def test_kv_only_cuts_as_rankguard_where_rankguards_first_lever_is_the_budget(
    rows: dict[str, phases.PhaseComparison],
) -> None:
    # rule 1's arithmetic is the same before and after issue 27: where rankguard moved the budget
    # first, the baseline's first cut is the operator's; but a KV-allocation OOM's cut also
    # leaves room for what comes after the KV cache (issue 50), so it cuts deeper there
    checked = 0
    for c in rows.values():
        rg = c.rankguard.argvs
        if len(rg) > 1 and _changed(rg[0], rg[1]) == {"kv"}:
            kv_only = parse_args(c.kv_only.argvs[1]).kv_cache_memory_bytes
            if c.phase == tm.PHASE_KV_ALLOCATION:
                assert kv_only > parse_args(rg[1]).kv_cache_memory_bytes
            else:
                assert kv_only == parse_args(rg[1]).kv_cache_memory_bytes
            checked += 1
    assert checked >= 3  # kv-allocation, sampler warm-up, serving


def test_kv_only_stops_at_the_floor_and_changes_nothing_on_other_failures() -> None:
    scenario = load_scenario("oom-cuda-graphs")
    spec_doc = phases.phase_spec(scenario)
    spec = parse_spec(spec_doc)
    floor = kv_floor(spec, prior_plan(spec))
    at_floor = phases.with_flag(world.utilization_argv(scenario, 0.92), "--kv-cache-memory-bytes", str(floor))
    run = world.run_world(scenario, at_floor)
    assert run.crashed
    assert phases.kv_only_next(scenario, spec_doc, at_floor, run)[0] is None
    refused = dataclasses.replace(run, failure_lines=("ValueError: something else",))
    after, why = phases.kv_only_next(scenario, spec_doc, at_floor, refused)
    assert after == tuple(at_floor) and "not a CUDA OOM" in why


def test_the_by_hand_recipe() -> None:
    argv = ("serve", "m", "--gpu-memory-utilization", "0.92")
    one = phases.by_hand_next(argv, 1)
    two = phases.by_hand_next(one, 2)
    three = phases.by_hand_next(two, 3)
    assert parse_args(one).gpu_memory_utilization == 0.46 and not parse_args(one).enforce_eager
    assert parse_args(two).gpu_memory_utilization == 0.46 and parse_args(two).enforce_eager
    assert parse_args(three).gpu_memory_utilization == 0.23 and parse_args(three).enforce_eager
    assert three.count("--enforce-eager") == 1 and three.count("--gpu-memory-utilization") == 1


def test_without_the_phase_rankguard_would_answer_the_profile_oom_with_the_kv_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The comparison depends on the phase reaching the operator: a termination without it (an
    # older agent, or the bench before issue 27) makes rankguard rule 1 again, which cannot fix
    # the profile run.
    real = world.termination_message

    def no_phase(run: world.WorldRun, n_ranks: int) -> TerminationMessage:
        return dataclasses.replace(real(run, n_ranks), phase=None)

    monkeypatch.setattr(world, "termination_message", no_phase)
    scenario = load_scenario("oom-profile")
    rg = phases.run_rankguard(scenario, phases.phase_spec(scenario))
    assert rg.outcome != phases.SERVING
    assert "max_num_batched_tokens" not in _changed(rg.argvs[0], rg.argvs[-1])


def test_the_phase_table_has_a_row_per_scenario_and_strategy(rows: dict[str, phases.PhaseComparison]) -> None:
    table = phases.render_phase_table(list(rows.values())).splitlines()
    assert len(table) == 2 + 3 * len(world.PHASE_SCENARIOS)
    for name, c in rows.items():
        assert sum(line.startswith(f"| {name} ({c.phase}) | rankguard |") for line in table) == 1
    text = phases.render_phases(list(rows.values()), traces=True)
    assert "[KV only] run 1:" in text and "[by hand] run 1:" in text
    assert not set(world.PHASE_SCENARIOS) & set(world.SKIPPED)


def test_main_prints_the_phase_table_for_a_phase_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert cs.main(["--scenario", "oom-profile", "--no-trace"]) == 0
    out = capsys.readouterr().out
    assert "Per OOM phase (issue 27)" in out and out.count("| oom-profile (profile) | rankguard |") == 1
    assert "(c) rankguard" not in out  # no GPU scenario asked for: no KV table
