"""Per OOM phase (issue 27): three ways to answer an OOM, on the seven phase scenarios.

Each phase scenario runs out of memory in one phase of vLLM's start-up or serving, where one
lever fixes it (docs/remediation.md). Three strategies restart the engine from a `vllm serve`
command line (resolved by `rankguard_sim.fake_vllm.args.engine_config_from_argv`, as the rest
of the bench) until one run survives the scenario's whole load, at most PHASE_MAX_RUNS runs:

  rankguard  the operator's own reconcile step, run by strategies_runner.simulate_rankguard
             exactly as for the KV table; each crash reaches it as the agent's termination
             message, with the phase the agent reads off the engine's printed traceback
             (strategies_world.termination_message). Degraded (nothing left to roll) ends it.
  KV only    rankguard's rule before issue 27 (`kv_only_next`): every CUDA OOM cuts the KV budget.
  by hand    what a person does (`by_hand_next`): halve the utilisation, then --enforce-eager,
             then keep halving.

All three start from the same command line: the one rankguard's first pod runs for the
service's spec with spec.memory.gpuMemoryUtilization 0.92 (the scenario's engine flags at vLLM's
default utilisation, which is where each scenario's OOM happens; `phase_spec`). Each result
says how the service ended (serving, degraded: the strategy stopped changing anything, or never
stable: still crashing after PHASE_MAX_RUNS runs), the crashes after the first, the KV cache and
max-num-seqs of the run that serves, and the flags that moved from the first run to the last.

Pure and deterministic (simulated time, no I/O): `compare_phase` measures, `render_phases`
formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_agent.wire.termination import CUDA_OOM
from rankguard_operator.core.budget.bounds import (
    VLLM_DEFAULT_UTILIZATION,
    block_unit,
    kv_floor,
    prior_plan,
    round_down,
    utilization_kv_bytes,
)
from rankguard_operator.core.observe.pods import kv_bytes_from_line
from rankguard_operator.core.policy.tunables import UNKNOWN_DEFICIT_FRACTION, UNKNOWN_DEFICIT_MIN_BYTES
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.physics.engine_outcome import true_max_safe_kv
from rankguard_sim.physics.scenario_data import GIB, Scenario
from rankguard_sim.physics.scenario_file import load_scenario
from strategies_runner import StrategyResult, simulate_rankguard
from strategies_world import WorldRun, engine_config, run_world, spec_for, termination_message

PHASE_MAX_RUNS = 12  # engine starts per strategy; a strategy still crashing then is "never stable"
SERVING, DEGRADED, NEVER_STABLE = "serving", "degraded", "never stable"

# spec.remediation.minKVCacheBytes of the services the two CUDA-graph scenarios describe ("the
# 4.5 GiB floor the service sets"): with it, cutting the budget by the deficit is not allowed,
# which is what makes those scenarios a capture-size or eager story
# (tests/unit/sim/physics/test_engine_outcome_phases.py).
SERVICE_KV_FLOORS = {"oom-cuda-graphs": int(4.5 * GIB), "oom-cuda-graphs-eager": int(4.5 * GIB)}


def phase_spec(
    scenario: Scenario, *, start_utilization: float | None = VLLM_DEFAULT_UTILIZATION
) -> dict[str, Any]:
    """The LLMService spec of a phase scenario: strategies_world.spec_for's, the service's KV
    floor where the scenario names one, and (unless None) a start at a utilisation, so that vLLM
    sizes the first run's KV cache itself as each scenario's story has it."""
    doc = spec_for(scenario)
    if start_utilization is not None:
        doc["memory"]["gpuMemoryUtilization"] = start_utilization
    floor = SERVICE_KV_FLOORS.get(scenario.name)
    if floor is not None:
        doc["remediation"] = {"minKVCacheBytes": floor}
    return doc


# ---------------------------------------------------------------------------------------------
# Command lines


def with_flag(argv: Sequence[str], flag: str, value: str | None = None) -> tuple[str, ...]:
    """`argv` with `flag` set to `value` (replaced in place when present), or the switch `flag`
    added when `value` is None."""
    out = list(argv)
    if flag in out:
        if value is not None:
            out[out.index(flag) + 1] = value
        return tuple(out)
    return tuple(out + ([flag] if value is None else [flag, value]))


def _budget_text(argv: Sequence[str]) -> str:
    ns = parse_args(argv)
    if ns.kv_cache_memory_bytes is not None:
        return f"{ns.kv_cache_memory_bytes / GIB:.2f} GiB"
    return f"util {ns.gpu_memory_utilization:g}"


def moved_flags(scenario: Scenario, first: Sequence[str], last: Sequence[str]) -> tuple[str, ...]:
    """What moved between two runs' command lines: the KV budget as the flags say it (bytes, or
    the utilisation while there are none), then each lever's value in effect (vLLM's resolution:
    a capture size nobody set is vLLM's default)."""
    moved = []
    if _budget_text(first) != _budget_text(last):
        moved.append(f"KV budget {_budget_text(first)} → {_budget_text(last)}")
    a, b = engine_config(scenario, first), engine_config(scenario, last)
    for name in ("max_num_batched_tokens", "max_num_seqs", "max_cudagraph_capture_size"):
        if name == "max_cudagraph_capture_size" and b.enforce_eager:
            continue  # eager captures nothing: the size means nothing any more
        if getattr(a, name) != getattr(b, name):
            moved.append(f"{name.replace('_', '-')} {getattr(a, name)} → {getattr(b, name)}")
    if a.enforce_eager != b.enforce_eager:
        moved.append(f"enforce-eager {'on' if b.enforce_eager else 'off'}")
    return tuple(moved)


def _run_text(run: WorldRun) -> str:
    o = run.outcome
    if not o.crashes:
        return f"survives the load with {o.kv_tokens:,} KV tokens"
    where = f" at {o.running_seqs} running seqs" if o.running_seqs is not None else ""
    return f"{o.reason} on rank {o.rank} in {o.phase}{where}"


# ---------------------------------------------------------------------------------------------
# The two baselines' rules: the next command line after a crash, or None (stop), and why


def kv_only_next(
    scenario: Scenario, spec_doc: dict[str, Any], argv: Sequence[str], run: WorldRun
) -> tuple[tuple[str, ...] | None, str]:
    """rankguard's rule 1 before issue 27 (`git show 181353b:operator/rankguard_operator/core/
    policy/crash_rules.py`, rule_cuda_oom and budget_change), and nothing else: every CUDA OOM
    cuts --kv-cache-memory-bytes by the termination's deficit (requested − free; when unknown,
    max(256 MiB, 5 % of the budget), the operator's UNKNOWN_DEFICIT_*) plus the spec's safety
    margin, in whole blocks, always by at least one block, never below the KV floor (one request
    of max-model-len, spec.remediation.minKVCacheBytes). Under a utilisation the budget cut is the
    KV cache vLLM reported in that run (the termination's "Available KV cache memory", when the
    crash came after vLLM sized it), else the operator's estimate of what that utilisation leaves
    for KV. A cut below the floor sets
    the floor; an OOM at the floor stops the rule (the old operator said Degraded OOMAtFloor).
    Any other failure changes nothing. The other flags never change; the utilisation stays next
    to the budget, where vLLM reads it only for its start-up check."""
    message = termination_message(run, scenario.world_size)
    if message.reason != CUDA_OOM:
        return tuple(argv), f"{message.reason}: not a CUDA OOM, the rule changes nothing"
    spec = parse_spec(spec_doc)
    plan = prior_plan(spec)
    unit, floor = block_unit(plan), kv_floor(spec, plan)
    ns = parse_args(argv)
    current: int | None = ns.kv_cache_memory_bytes
    reported = kv_bytes_from_line(message.last_kv_line)
    if current is not None:
        base = current
    elif reported is not None:
        base = reported
    elif plan is not None:
        base = utilization_kv_bytes(plan, ns.gpu_memory_utilization, message.rank)
    else:
        return None, "NoBudgetToConvert: no plan to estimate the budget a utilisation leaves; stops"
    known = message.requested_bytes is not None and message.free_bytes is not None
    deficit = (
        max(0, (message.requested_bytes or 0) - (message.free_bytes or 0))
        if known
        else max(UNKNOWN_DEFICIT_MIN_BYTES, int(base * UNKNOWN_DEFICIT_FRACTION))
    )
    target = round_down(base - deficit - spec.memory.safety_margin_bytes, unit)
    if current is not None:
        target = min(target, current - unit)  # a shrink always shrinks
    cut = f"{base / GIB:.2f} GiB − deficit {deficit / GIB:.2f} GiB − margin"
    if target < floor:
        if current is not None and current <= floor:
            return None, f"OOMAtFloor: the KV budget is already at its floor {floor / GIB:.2f} GiB; stops"
        target, cut = floor, f"{cut} is below the floor: the floor"
    return with_flag(
        argv, "--kv-cache-memory-bytes", str(target)
    ), f"KV budget {cut} = {target / GIB:.2f} GiB"


def by_hand_next(argv: Sequence[str], failures: int) -> tuple[str, ...]:
    """A person after their `failures`-th failed start (any failure: they read "it crashed"):
    halve --gpu-memory-utilization after the first, add --enforce-eager after the second, halve
    the utilisation again after every later one (two decimals, as typed; 0.01 at least)."""
    if failures == 2:
        return with_flag(argv, "--enforce-eager")
    util = parse_args(argv).gpu_memory_utilization
    return with_flag(argv, "--gpu-memory-utilization", f"{max(0.01, round(util / 2, 2)):g}")


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class PhaseResult:
    strategy: str
    outcome: str  # SERVING, DEGRADED or NEVER_STABLE
    crashes: int  # failed runs, the first included (rankguard: with the kubelet's restarts meanwhile)
    argvs: tuple[tuple[str, ...], ...]  # every run's command line, in order
    kv_tokens: int  # the serving run's KV cache in tokens; 0 when nothing serves
    kv_share: float | None  # of the world's true maximum under the final flags; None: n/a
    max_num_seqs: int | None  # in effect in the serving run; None when nothing serves
    moved: tuple[str, ...]  # flags that moved from the first run to the last
    trace: tuple[str, ...]
    why: str = ""  # for DEGRADED: why the strategy stopped

    @property
    def crashes_after_first(self) -> int:
        return max(0, self.crashes - 1)


@dataclass(frozen=True)
class PhaseComparison:
    scenario: str
    phase: str | None  # the phase the agent reports for the first run's OOM
    rankguard: PhaseResult
    kv_only: PhaseResult
    by_hand: PhaseResult
    rankguard_planned: PhaseResult  # rankguard from its own plan (no utilisation start): notes only

    @property
    def results(self) -> tuple[PhaseResult, PhaseResult, PhaseResult]:
        return self.rankguard, self.kv_only, self.by_hand


def _result(
    scenario: Scenario,
    strategy: str,
    *,
    outcome: str,
    crashes: int,
    argvs: Sequence[tuple[str, ...]],
    trace: Sequence[str],
    why: str = "",
) -> PhaseResult:
    """A strategy's result, the serving run's figures from the world."""
    kv_tokens, share, seqs = 0, None, None
    if outcome == SERVING:
        final = argvs[-1]
        run = run_world(scenario, final)
        config, ns = engine_config(scenario, final), parse_args(final)
        kv_tokens, seqs = run.outcome.kv_tokens, config.max_num_seqs
        truth = true_max_safe_kv(
            scenario,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enforce_eager=config.enforce_eager,
            max_cudagraph_capture_size=ns.max_cudagraph_capture_size,
        )
        share = run.outcome.num_gpu_blocks / truth.num_gpu_blocks if truth.num_gpu_blocks > 0 else None
    return PhaseResult(
        strategy=strategy,
        outcome=outcome,
        crashes=crashes,
        argvs=tuple(argvs),
        kv_tokens=kv_tokens,
        kv_share=share,
        max_num_seqs=seqs,
        moved=moved_flags(scenario, argvs[0], argvs[-1]),
        trace=tuple(trace),
        why=why,
    )


def run_rankguard(scenario: Scenario, spec_doc: dict[str, Any], name: str = "rankguard") -> PhaseResult:
    truth = true_max_safe_kv(scenario)
    r: StrategyResult = simulate_rankguard(scenario, truth, max_runs=PHASE_MAX_RUNS, spec_doc=spec_doc)
    outcome = SERVING if r.stable else DEGRADED if r.degraded is not None else NEVER_STABLE
    return _result(
        scenario, name, outcome=outcome, crashes=r.crashes, argvs=r.argvs, trace=r.trace, why=r.degraded or ""
    )


def run_kv_only(scenario: Scenario, spec_doc: dict[str, Any], first: Sequence[str]) -> PhaseResult:
    argv, argvs, trace, crashes = tuple(first), [], [], 0
    for n in range(1, PHASE_MAX_RUNS + 1):
        argvs.append(argv)
        run = run_world(scenario, argv)
        trace.append(f"run {n}: {_budget_text(argv)}: {_run_text(run)}")
        if not run.crashed:
            return _result(scenario, "KV only", outcome=SERVING, crashes=crashes, argvs=argvs, trace=trace)
        crashes += 1
        after, why = kv_only_next(scenario, spec_doc, argv, run)
        trace.append(f"  -> {why}")
        if after is None:
            return _result(
                scenario, "KV only", outcome=DEGRADED, crashes=crashes, argvs=argvs, trace=trace, why=why
            )
        argv = after
    return _result(scenario, "KV only", outcome=NEVER_STABLE, crashes=crashes, argvs=argvs, trace=trace)


def run_by_hand(scenario: Scenario, first: Sequence[str]) -> PhaseResult:
    argv, argvs, trace, crashes = tuple(first), [], [], 0
    for n in range(1, PHASE_MAX_RUNS + 1):
        argvs.append(argv)
        run = run_world(scenario, argv)
        eager = " + eager" if parse_args(argv).enforce_eager else ""
        trace.append(f"run {n}: {_budget_text(argv)}{eager}: {_run_text(run)}")
        if not run.crashed:
            return _result(scenario, "by hand", outcome=SERVING, crashes=crashes, argvs=argvs, trace=trace)
        crashes += 1
        argv = by_hand_next(argv, crashes)
    return _result(scenario, "by hand", outcome=NEVER_STABLE, crashes=crashes, argvs=argvs, trace=trace)


def compare_phase(name: str) -> PhaseComparison:
    scenario = load_scenario(name)
    spec_doc = phase_spec(scenario)
    rankguard = run_rankguard(scenario, spec_doc)
    first = rankguard.argvs[0]  # the command line all three start from
    opening = run_world(scenario, first)
    return PhaseComparison(
        scenario=name,
        phase=termination_message(opening, scenario.world_size).phase if opening.crashed else None,
        rankguard=rankguard,
        kv_only=run_kv_only(scenario, spec_doc, first),
        by_hand=run_by_hand(scenario, first),
        rankguard_planned=run_rankguard(scenario, phase_spec(scenario, start_utilization=None)),
    )


# ---------------------------------------------------------------------------------------------
# The table


def _outcome_cell(r: PhaseResult) -> str:
    if r.outcome == DEGRADED:
        return f"degraded ({r.why.split(':')[0]}), not serving"
    return r.outcome


def _kv_cell(r: PhaseResult) -> str:
    if r.outcome != SERVING:
        return "— (not serving)"
    share = "" if r.kv_share is None else f" ({100 * r.kv_share:.1f} %)"
    return f"{r.kv_tokens:,}{share}"


def _row_cells(r: PhaseResult) -> str:
    seqs = "—" if r.max_num_seqs is None else str(r.max_num_seqs)
    moved = "; ".join(r.moved) or "none"
    return f"{r.strategy} | {_outcome_cell(r)} | {r.crashes_after_first} | {_kv_cell(r)} | {seqs} | {moved} |"


def render_phase_table(rows: Sequence[PhaseComparison]) -> str:
    lines = [
        "| scenario (phase of the first OOM) | strategy | outcome | crashes after the first "
        "| KV tokens kept (% of true max) | max-num-seqs kept | flags moved (first run → last) |",
        "|" + "---|" * 7,
    ]
    for c in rows:
        for i, r in enumerate(c.results):
            head = f"{c.scenario} ({c.phase or 'unknown'})" if i == 0 else ""
            lines.append(f"| {head} | {_row_cells(r)}")
    return "\n".join(lines)


PHASE_NOTES = """\
Each strategy restarts the engine until a run survives the whole load, at most {runs} runs;
"never stable" is still crashing then, "degraded" stopped changing flags with nothing serving.
All three start from the command line rankguard renders for spec.memory.gpuMemoryUtilization 0.92
(the scenario's engine flags; the CUDA-graph services set remediation.minKVCacheBytes 4.5 GiB).
rankguard: the operator's reconcile step, the phase read by the agent from the engine's output.
KV only: rankguard's rule before issue 27 (every CUDA OOM cuts the KV budget by the deficit + the
safety margin, whole blocks, down to the floor; nothing else moves). By hand: halve the
utilisation, then --enforce-eager, then keep halving. KV tokens: the serving run's KV cache; the
share is of rankguard_sim.physics.engine_outcome.true_max_safe_kv under that run's own flags."""


def render_phases(rows: Sequence[PhaseComparison], *, traces: bool = True) -> str:
    out = [render_phase_table(rows), "", PHASE_NOTES.format(runs=PHASE_MAX_RUNS), ""]
    out.append("rankguard from its own plan (no utilisation start; the KV table's spec):")
    for c in rows:
        p = c.rankguard_planned
        out.append(
            f"  {c.scenario}: {_outcome_cell(p)}, crashes: {p.crashes}, "
            f"KV tokens {_kv_cell(p)}, moved: {'; '.join(p.moved) or 'none'}"
        )
    if traces:
        for c in rows:
            out += ["", f"{c.scenario} (per phase):"]
            for r in c.results:
                out += [f"  [{r.strategy}] {line}" for line in r.trace]
    return "\n".join(out)
