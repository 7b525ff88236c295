"""The vLLM 0.34 table of bench/compare_strategies.py: vanilla 0.34 and rankguard on 0.34, per case.

Runs the two strategies of strategies_measured.py on each case (`compare_measured`) and formats
the table, its notes and the traces (`render_measured`). Targets (issue 49): on clean GPUs
rankguard keeps >= 99.5 % of vanilla 0.34's KV tokens with no roll and no OOM; with a neighbour
or a connector, at most one OOM (none after the first) and >= 97 % of the true fit; without VMM,
pinned mode as today (rankguard on vLLM 0.33 on the same scenario: no more OOMs than it).

Pure and deterministic (simulated time, no I/O): builds strings, prints nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rankguard_operator import vllm_snapshots
from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.physics.engine_memory import rank_memory
from rankguard_sim.physics.engine_outcome import Outcome, SafeCapacity, true_max_safe_kv
from rankguard_sim.physics.scenario_file import load_scenario
from rankguard_sim.vllm_snapshot import playing
from strategies_group import GroupLoop
from strategies_loop import describe_flags
from strategies_measured import (
    FIT_SHARE,
    IMAGE,
    KEEP_SHARE,
    VERSION,
    MeasuredCase,
    MeasuredLoop,
    MeasuredRun,
    World,
    measured_spec,
    run_measured,
    vanilla_argv,
)
from strategies_runner import MAX_RUNS, StrategyResult, simulate_rankguard
from strategies_world import engine_config

# ---------------------------------------------------------------------------------------------
# The strategies on a case


@dataclass(frozen=True)
class MeasuredResult:
    result: StrategyResult  # crashes, runs, blocks, share of the true fit, final flags, trace
    kv_tokens: int  # the stable run's KV cache in tokens (vLLM's "GPU KV cache size"); 0: none
    mode: str  # how the stable run sized: "engine-measured", "estimate (fell back)", "pinned"
    oom_phases: tuple[str, ...] = ()


@dataclass(frozen=True)
class MeasuredComparison:
    case: MeasuredCase
    fit_blocks: int  # the true fit (see the module's docstring)
    fit_tokens: int
    physical_blocks: int  # `physical_max`: the world's bound with the case's outside memory
    vanilla: MeasuredResult
    rankguard: MeasuredResult
    today: StrategyResult | None = None  # no VMM: rankguard's pinned run on vLLM 0.33, as today

    @property
    def token_ratio(self) -> float | None:
        if not self.vanilla.kv_tokens or not self.rankguard.kv_tokens:
            return None
        return self.rankguard.kv_tokens / self.vanilla.kv_tokens

    @property
    def meets_target(self) -> bool:
        rg = self.rankguard.result
        if not rg.stable:
            return False
        if self.case.clean:
            return rg.crashes == 0 and rg.rolls == 0 and (self.token_ratio or 0.0) >= KEEP_SHARE
        if not self.case.vmm:
            return self.rankguard.mode == "pinned" and (
                self.today is not None and rg.crashes <= max(1, self.today.crashes)
            )
        return rg.crashes <= 1 and (rg.capacity or 0.0) >= FIT_SHARE


def _mode(run: MeasuredRun) -> str:
    if run.engine_measured:
        return "engine-measured"
    if run.fell_back:
        return "estimate (fell back)"
    return "pinned" if parse_args(run.argv).kv_cache_memory_bytes is not None else "estimate"


def _crash(o: Outcome) -> str:
    return f"{o.reason} on rank {o.rank} in {o.phase}"


def simulate_vanilla(case: MeasuredCase, fit_blocks: int) -> MeasuredResult:
    """vanilla 0.34: the same command line after every crash (the kubelet restarts it)."""
    world = World(case)
    argv = vanilla_argv(case)
    trace: list[str] = []
    crashes = 0
    for n in range(1, MAX_RUNS + 1):
        run = world(argv)
        if not run.crashed:
            o = run.outcome
            trace.append(f"run {n}: survives with {o.num_gpu_blocks:,} blocks ({_mode(run)})")
            res = StrategyResult("vanilla-0.34", True, crashes, n, o.num_gpu_blocks,
                                 o.num_gpu_blocks / fit_blocks, "util unset", tuple(trace))  # fmt: skip
            return MeasuredResult(res, o.kv_tokens, _mode(run), _phases(world.runs))
        crashes += 1
        trace.append(f"run {n}: {_crash(run.outcome)}")
    res = StrategyResult("vanilla-0.34", False, crashes, MAX_RUNS, 0, None, "util unset", tuple(trace))
    return MeasuredResult(res, 0, _mode(world.runs[-1]), _phases(world.runs))


def _phases(runs: Sequence[MeasuredRun]) -> tuple[str, ...]:
    return tuple(str(r.outcome.phase) for r in runs if r.crashed)


def simulate_measured_rankguard(case: MeasuredCase, fit_blocks: int) -> MeasuredResult:
    scenario = load_scenario(case.scenario)
    loop = (GroupLoop if scenario.nnodes > 1 else MeasuredLoop)(case, measured_spec(case))
    world = World(case, loop)
    truth = SafeCapacity(0, fit_blocks, 0, (), 0)
    res = simulate_rankguard(scenario, truth, loop=loop, world=world)
    last = world.runs[-1]
    res = dataclasses.replace(res, final_flags=f"{describe_flags(loop.flags)}, {_mode(last)}")
    tokens = last.outcome.kv_tokens if res.stable else 0
    return MeasuredResult(res, tokens, _mode(last), _phases(world.runs))


def true_fit(case: MeasuredCase) -> MeasuredRun:
    """vanilla 0.34 where nothing surprises it (the neighbour at its peak, the connector's
    buffers held, before it measures); must survive its load."""
    n = load_scenario(case.scenario).world_size
    run = run_measured(dataclasses.replace(case, vmm=True), vanilla_argv(case), [0] * n, foreseen=True)
    if run.crashed:
        raise AssertionError(f"{case.name}: the true fit's run crashes: {_crash(run.outcome)}")
    return run


def physical_max(case: MeasuredCase) -> int:
    """engine_outcome.true_max_safe_kv at 0.34's block size, less what is outside the engine on
    each GPU at its peak (the neighbour's, the connector's buffers), in whole blocks."""
    scenario = load_scenario(case.scenario)
    with playing(VERSION):
        block: int = vllm_snapshots.load(VERSION).default_block_size
        truth = true_max_safe_kv(scenario, block_size=block)
        config = engine_config(scenario, vanilla_argv(case))
    nb = case.neighbour
    blocks = []
    for m, room in zip(rank_memory(scenario, config), truth.headroom_per_rank, strict=True):
        outside = case.connector_bytes + (nb.hold + nb.grow if nb is not None and nb.gpu == m.rank else 0)
        blocks.append(max(0, room - outside) // m.block_bytes)
    return min(blocks)


def compare_measured(case: MeasuredCase) -> MeasuredComparison:
    scenario = load_scenario(case.scenario)
    physical = physical_max(case)
    if case.vmm:
        fit = true_fit(case)
        fit_blocks, fit_tokens = fit.outcome.num_gpu_blocks, fit.outcome.kv_tokens
    else:
        fit_blocks, fit_tokens = physical, 0
    # without VMM: rankguard on vLLM 0.33 (today's pinned mode) on the same scenario
    today = None if case.vmm else simulate_rankguard(scenario, true_max_safe_kv(scenario))
    return MeasuredComparison(
        case=case,
        fit_blocks=fit_blocks,
        fit_tokens=fit_tokens,
        physical_blocks=physical,
        vanilla=simulate_vanilla(case, fit_blocks),
        rankguard=simulate_measured_rankguard(case, fit_blocks),
        today=today,
    )


# ---------------------------------------------------------------------------------------------
# The table


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _ooms(n: int) -> str:
    return f"{n} OOM" if n == 1 else f"{n} OOMs"


def _cell(c: MeasuredComparison, m: MeasuredResult) -> str:
    r = m.result
    if not r.stable:
        last = m.oom_phases[-1] if m.oom_phases else "?"
        return f"crash-loop (∞: {r.crashes} OOMs in {MAX_RUNS} runs, last in {last}) · {m.mode}"
    ooms = _ooms(r.crashes)
    rolls = f"{r.rolls} roll" if r.rolls == 1 else f"{r.rolls} rolls"
    fit = "" if not c.case.vmm else f"{_pct(r.capacity)} of the fit, "
    physical = _pct(r.num_gpu_blocks / c.physical_blocks)
    return f"{ooms}, {rolls} · {m.kv_tokens:,} tokens ({fit}{physical} of the physical max) · {r.final_flags}"


def _target(c: MeasuredComparison) -> str:
    rg = c.rankguard.result
    verdict = "met" if c.meets_target else "MISSED"
    if c.case.clean:
        kept = _pct(c.token_ratio)
        return f"{verdict}: ≥ {100 * KEEP_SHARE:.1f} % of vanilla's tokens ({kept}), 0 OOMs, 0 rolls ({rg.rolls})"  # noqa: E501
    if c.case.vmm:
        got = "never stable" if not rg.stable else f"{_ooms(rg.crashes)}, {_pct(rg.capacity)}"
        return f"{verdict}: ≤ 1 OOM, ≥ {100 * FIT_SHARE:.0f} % of the fit ({got})"
    today = c.today
    was = (
        "—"
        if today is None
        else f"{today.crashes} OOMs, {_pct(today.capacity)} of its max, {today.final_flags}"
    )
    now = "never stable" if not rg.stable else _ooms(rg.crashes)
    return f"{verdict}: pinned as today (0.33: {was}; 0.34: {c.rankguard.mode}, {now})"


def render_measured_table(rows: Sequence[MeasuredComparison]) -> str:
    head = (
        "| case | true fit | vanilla vLLM 0.34 (utilisation unset) | rankguard on 0.34 "
        "| rankguard ÷ vanilla, KV tokens | target |"
    )
    lines = [head, "|" + "---|" * 6]
    for c in rows:
        fit = (
            f"{c.fit_tokens:,} tokens ({c.fit_blocks:,} blocks)"
            if c.case.vmm
            else "— (pinned: the physical max)"
        )
        ratio = "n/a" if c.token_ratio is None else f"{c.token_ratio:.4f}"
        lines.append(
            f"| {c.case.name}: {c.case.what} | {fit} | {_cell(c, c.vanilla)} | {_cell(c, c.rankguard)} "
            f"| {ratio} | {_target(c)} |"
        )
    return "\n".join(lines)


NOTES = """\
Each cell: OOM crashes until stable, rolls (engine starts after the first) · the stable run's KV
cache in tokens (vLLM's "GPU KV cache size"), as a share of the true fit and of the physical max ·
final flags, how the engine sized. Both strategies run vLLM {version} in the simulated world
(rankguard_sim.vllm_snapshot.playing, physics/engine_measured.py), block size {block} (0.34's
default: neither sets it). Vanilla restarts the same command line after every crash, at most {runs}
runs. rankguard is the operator's reconcile step for image {image} (strategies_runner's loop; the
two-pod group over its StatefulSets, strategies_group.py). The true fit: vanilla 0.34 in a world
where the neighbour is at its peak and the connector's buffers are held before the engine measures
(what its own sizing keeps when nothing surprises it). The physical max:
engine_outcome.true_max_safe_kv at block size {block} (total − every non-KV byte − the peak
transient) less the neighbour's peak and the connector's buffers. vLLM's own margin (max(1 GiB, 0.75
× the transient peak)) keeps its fit below the physical max; a utilisation low enough to bind before
that margin replaces it (a share of the fit above 100 %). The neighbour is another process on GPU 0
(2 GiB from before the engine starts, 6 GiB more once the load starts, taking only what is free and
the rest once the engine dies); the agent reports it as others. The connector's 2 GiB per GPU are
allocated by the engine process right after it commits the KV cache (vLLM creates the connector in
extend_kv_cache, after measuring), outside torch's cap, and are never reported as others. Without
VMM vLLM falls back to its estimate at 0.92; the agent reports vmm: false and the engine's reason;
"as today" is rankguard on vLLM 0.33 on the same scenario (the KV table's row)."""


def render_measured(rows: Sequence[MeasuredComparison], *, traces: bool = True) -> str:
    block = vllm_snapshots.load(VERSION).default_block_size
    out = [
        render_measured_table(rows),
        "",
        NOTES.format(version=VERSION, block=block, runs=MAX_RUNS, image=IMAGE),
    ]
    if traces:
        for c in rows:
            out += ["", f"{c.case.name}:"]
            out += [f"  (vanilla) {line}" for line in c.vanilla.result.trace]
            out += [f"  (rankguard) {line}" for line in c.rankguard.result.trace]
    return "\n".join(out)
