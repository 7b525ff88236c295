"""The results table and the trace that bench/compare_strategies.py prints.

One row per scenario (each strategy's OOM crashes until stable, the KV it keeps as a share of
the world's true maximum, its final flags, and whether rankguard met the target), the notes
that say how the figures were made, rankguard without the probe, the skipped scenarios, and
each decision rankguard took and each run of (b).

Held apart from the runner (strategies_runner.py) so that how the figures are shown can change
without touching how they are measured. Pure: builds strings, prints nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.physics.scenario_data import GIB
from rankguard_sim.physics.scenario_file import load_scenario
from strategies_runner import (
    MAX_ROLLS,
    MAX_RUNS,
    SETTLE_SECONDS,
    STARTUP_SECONDS,
    TARGET_SHARE,
    ScenarioComparison,
    StrategyResult,
)
from strategies_world import GPU_SCENARIOS, SKIPPED, spec_for


def _pct(x: float | None) -> str:
    return "0 % (never stable)" if x is None else f"{100 * x:.1f} %"


def _crashes(r: StrategyResult) -> str:
    if not r.stable:
        return "crash-loop (∞)"
    return f"{r.crashes} OOM" if r.crashes == 1 else f"{r.crashes} OOMs"


def _cell(r: StrategyResult) -> str:
    return f"{_crashes(r)} · {_pct(r.capacity)} · {r.final_flags}"


def _target(c: ScenarioComparison) -> str:
    rg = c.rankguard
    if c.meets_target:
        return f"met ({rg.crashes} OOM, {_pct(rg.capacity)})"
    why = []
    if not rg.stable:
        why.append("never stable")
    if rg.crashes > 1:
        why.append(f"{rg.crashes} OOMs")
    if rg.rolls > MAX_ROLLS:
        why.append(f"{rg.rolls} rolls")
    if rg.capacity is not None and rg.capacity < TARGET_SHARE:
        why.append(f"{_pct(rg.capacity)} < {100 * TARGET_SHARE:.0f} %")
    if rg.capacity is not None and rg.capacity > 1.0:
        why.append("above the true maximum")
    return "MISSED (" + ", ".join(why) + ")"


def render_table(rows: Sequence[ScenarioComparison]) -> str:
    head = (
        "| scenario | true max safe KV | (a) vLLM default 0.92 | (b) −0.05 per OOM | (c) rankguard "
        f"| (c) ÷ best of (a),(b) | target: ≤ 1 OOM, ≤ {MAX_ROLLS} rolls, ≥ {100 * TARGET_SHARE:.0f} % |"
    )
    lines = [head, "|" + "---|" * 7]
    for c in rows:
        ratio = "n/a" if c.ratio is None else f"{c.ratio:.3f}"
        truth = (
            f"{c.truth.num_gpu_blocks:,} blocks ({c.truth.num_gpu_blocks * c.block_bytes / GIB:.2f} GiB/GPU)"
        )
        lines.append(
            f"| {c.scenario} | {truth} | {_cell(c.default)} | {_cell(c.human)} | {_cell(c.rankguard)} "
            f"| {ratio} | {_target(c)} |"
        )
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "util" if n is None else f"{n / GIB:.2f}"


def render_path(rows: Sequence[ScenarioComparison]) -> str:
    """rankguard's path on each scenario: the planner's first budget, every budget a run
    started with, and where it converged, each as a share of the world's true maximum."""
    head = (
        "| scenario | true max GiB/GPU | planned (first start) | converged | rolls | OOMs "
        "| KV budget per start, GiB |"
    )
    lines = [head, "|" + "---|" * 7]
    for c in rows:
        rg = c.rankguard
        true_bytes = c.truth.num_gpu_blocks * c.block_bytes
        # each start's budget, read by the fake vLLM's parser (None: a utilisation)
        path = [parse_args(argv).kv_cache_memory_bytes for argv in rg.argvs]
        first = path[0] if path else None
        planned = "util" if first is None else f"{first / GIB:.2f} GiB ({100 * first / true_bytes:.1f} %)"
        lines.append(
            f"| {c.scenario} | {true_bytes / GIB:.2f} | {planned} | {_pct(rg.capacity)} | {rg.rolls} "
            f"| {rg.crashes} | {' → '.join(_gib(n) for n in path)} |"
        )
    return "\n".join(lines)


NOTES = """\
Each cell: OOM crashes until stable · KV blocks kept, as a share of the true maximum · final flags.
Stable: a run survives the scenario's whole load pattern (ramp to the peak batch, hold); for
rankguard also {settle:.0f} more minutes of operator passes without a change. The true maximum is
rankguard_sim.physics.engine_outcome.true_max_safe_kv: per rank, total − every non-KV byte − the peak
transient. (a) never changes the flags, so a setup that crashes at 0.92 crash-loops (cut off after
{runs} runs) and keeps no capacity that survives the load: 0 %. (b) lowers the utilisation by 0.05
per OOM. (c) runs the operator's reconcile step (rankguard_operator.core.step.reconcile.step) once per
pass with spec.memory.gpuMemoryBytes set: a plan from priors, a replan from the agent's probe once
the pod is up, each crash read from the pod's termination message, every run started from the
command line in the Deployment the step applied; the guard rails apply (cooldown {cooldown} s,
{per_hour} changes per hour) and simulated time moves past them ({startup:.0f} s per start, nominal)."""


def render(rows: Sequence[ScenarioComparison], *, traces: bool = True) -> str:
    spec = parse_spec(spec_for(load_scenario(GPU_SCENARIOS[0])))
    out = [
        render_table(rows),
        "",
        "rankguard's path (the planner's first budget, each start's budget, the converged share):",
        "",
        render_path(rows),
        "",
        NOTES.format(
            settle=SETTLE_SECONDS / 60,
            runs=MAX_RUNS,
            cooldown=spec.remediation.cooldown_seconds,
            per_hour=spec.remediation.max_per_hour,
            startup=STARTUP_SECONDS,
        ),
        "",
        "rankguard without the probe (spec.agent.probe: false; priors, then reclaim):",
    ]
    for c in rows:
        out.append(f"  {c.scenario}: {_cell(c.rankguard_no_probe)}")
    for name, why in SKIPPED.items():
        out.append(f"Skipped {name}: {why}.")
    if traces:
        for c in rows:
            out += ["", f"{c.scenario}:"]
            out += [f"  (b) {line}" for line in c.human.trace]
            out += [f"  (c) {line}" for line in c.rankguard.trace]
    return "\n".join(out)
