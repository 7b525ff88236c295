"""The three KV strategies of bench/compare_strategies.py, run against the simulated world.

(a) and (b), `simulate_utilization`: `vllm serve` at a utilisation, fixed or lowered by hand
after every OOM. (c), `simulate_rankguard`: `RankguardLoop`, the operator's own reconcile step
(`rankguard_operator.core.step.reconcile.step`), one call per operator pass, on what the edge
would hand it (the spec and status, the Deployment it applied, the pod made from that
Deployment's template, the agents' reports), with the step's effects carried out by the
operator's one in-memory replay (`rankguard_operator.core.step.Objects`), so the bench keeps no
copy of the executor's rules. `compare` runs all of them on one scenario.

Apart from the world (strategies_world.py, seen through its reports), the operator's loop
(strategies_loop.py) and the table (strategies_table.py).

Deterministic and pure: simulated time, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rankguard_operator.core.budget.bounds import VLLM_DEFAULT_UTILIZATION  # vLLM's own default
from rankguard_operator.core.policy.tunables import RECLAIM_AFTER_SECONDS
from rankguard_sim.physics.engine_memory import rank_memory
from rankguard_sim.physics.engine_outcome import Outcome, SafeCapacity, true_max_safe_kv
from rankguard_sim.physics.scenario_data import GIB, Scenario
from rankguard_sim.physics.scenario_file import load_scenario
from strategies_loop import T0, RankguardLoop, describe_flags
from strategies_world import (
    WorldRun,
    crashloop_restarts,
    engine_config,
    run_world,
    utilization_argv,
)

HUMAN_STEP = 0.05  # "the usual human fix (drop it by 0.05)" (DESIGN §1)
MAX_RUNS = 20  # runs per strategy before it is called "never stable"
TARGET_SHARE = 0.98  # rankguard within 2 % of the true maximum once converged (issue 28; 3 % in issue 6)
MAX_ROLLS = 2  # rolls after the first start to get there (issue 28)

# Simulated time (strategies_loop.T0 on): only the policy's guard rails read it (cooldown, hourly
# limit, how long low headroom lasted), so the figures are nominal: a 70B model takes minutes to
# load on real hardware, and the operator scrapes every few seconds, well inside the idle phase.
STARTUP_SECONDS = 120.0
PASS_SECONDS = 30.0  # operator passes after a run survived (the real loop runs every 2 s)
# After a run survives, the policy is asked again for this long before the result counts as
# stable: long enough for a low-headroom shrink (60 s sustained), a held action (cooldown
# 300 s) and a reclaim (30 min of ample headroom) to happen if the policy wants one.
SETTLE_SECONDS = 2 * RECLAIM_AFTER_SECONDS


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class StrategyResult:
    strategy: str
    stable: bool  # a run survived the full load (and, for rankguard, the policy left it alone)
    crashes: int  # OOM crashes until stable (all runs that crashed, when never stable)
    runs: int  # engine starts, the stable one included
    num_gpu_blocks: int  # KV blocks of the stable run; 0 when never stable
    capacity: float | None  # num_gpu_blocks / the true maximum's blocks; None when never stable
    final_flags: str
    trace: tuple[str, ...] = field(default_factory=tuple)
    final_argv: tuple[str, ...] = ()  # the `vllm` command line of the stable run (rankguard's)
    argvs: tuple[tuple[str, ...], ...] = ()  # every run's command line, in order (rankguard's)
    degraded: str | None = None  # rankguard stopped rolling after a crash: the Degraded reason

    @property
    def rolls(self) -> int:
        """Engine starts after the first: each is a roll of the Deployment (or a restart)."""
        return max(0, self.runs - 1)


@dataclass(frozen=True)
class ScenarioComparison:
    scenario: str
    truth: SafeCapacity
    block_bytes: int
    default: StrategyResult
    human: StrategyResult
    rankguard: StrategyResult
    # rankguard with spec.agent.probe: false (priors, then reclaim): not in the table, it
    # shows what the probe-measured replan costs and gains
    rankguard_no_probe: StrategyResult

    @property
    def best_baseline(self) -> float:
        """The better capacity of (a) and (b); a strategy that never stabilises keeps 0."""
        return max(self.default.capacity or 0.0, self.human.capacity or 0.0)

    @property
    def ratio(self) -> float | None:
        if self.rankguard.capacity is None or self.best_baseline <= 0:
            return None
        return self.rankguard.capacity / self.best_baseline

    @property
    def meets_target(self) -> bool:
        """Zero crashes after the first, at most MAX_ROLLS rolls, and within 2 % of (never
        above) the true maximum."""
        rg = self.rankguard
        return (
            rg.stable
            and rg.crashes <= 1
            and rg.rolls <= MAX_ROLLS
            and rg.capacity is not None
            and TARGET_SHARE <= rg.capacity <= 1.0
        )


def _share(blocks: int, truth: SafeCapacity) -> float:
    return blocks / truth.num_gpu_blocks


def _crash_text(o: Outcome) -> str:
    where = f" at {o.running_seqs} running seqs" if o.running_seqs is not None else ""
    return f"{o.reason} on rank {o.rank} in {o.phase}{where}"


# ---------------------------------------------------------------------------------------------
# (a) and (b): utilisation, fixed or lowered by hand


def simulate_utilization(
    scenario: Scenario,
    truth: SafeCapacity,
    *,
    start: float = VLLM_DEFAULT_UTILIZATION,
    step: float = 0.0,
    max_runs: int = MAX_RUNS,
    name: str = "",
) -> StrategyResult:
    """Run at `start`; after each crash lower the utilisation by `step` (0: never change it)."""
    util = start
    crashes = 0
    trace: list[str] = []
    for run in range(1, max_runs + 1):
        o = run_world(scenario, utilization_argv(scenario, util)).outcome
        if not o.crashes:
            trace.append(f"run {run}: util {util:g} survives with {o.num_gpu_blocks:,} blocks")
            return StrategyResult(
                strategy=name,
                stable=True,
                crashes=crashes,
                runs=run,
                num_gpu_blocks=o.num_gpu_blocks,
                capacity=_share(o.num_gpu_blocks, truth),
                final_flags=f"util {util:g}",
                trace=tuple(trace),
            )
        crashes += 1
        trace.append(f"run {run}: util {util:g}: {_crash_text(o)}")
        # two decimals, as a person types it (0.92 - 0.05 is 0.8700000000000001 in binary)
        lower = round(util - step, 2)
        if step > 0 and lower > 0:
            util = lower
    return StrategyResult(
        strategy=name,
        stable=False,
        crashes=crashes,
        runs=max_runs,
        num_gpu_blocks=0,
        capacity=None,
        final_flags=f"util {util:g}",
        trace=tuple(trace),
    )


# ---------------------------------------------------------------------------------------------
# (c) rankguard: the operator's reconcile step, pass after pass, on the simulated cluster


def simulate_rankguard(
    scenario: Scenario,
    truth: SafeCapacity,
    *,
    probe: bool = True,
    max_runs: int = MAX_RUNS,
    spec_doc: dict[str, Any] | None = None,
    loop: RankguardLoop | None = None,
    world: Callable[[Sequence[str]], WorldRun] | None = None,
) -> StrategyResult:
    """rankguard from `kubectl apply` until a run survives the load and the operator keeps it
    (`loop`, `world`: another loop and world, as strategies_measured's for vLLM 0.34).

    Per run: the pod starts from the Deployment's template; once vLLM is up the operator
    scrapes the agent before the load arrives (the scenarios idle for seconds; the operator
    passes every 2 s), so a change decided then (the probe-measured replan) replaces the pod
    before it could crash. A crash is then read from the pod's termination. A run that
    survives is kept under observation for SETTLE_SECONDS; any change the operator makes then
    (a low-headroom shrink, a reclaim) rolls a new run.
    """
    loop = RankguardLoop(scenario, probe=probe, spec_doc=spec_doc) if loop is None else loop
    play = partial(run_world, scenario) if world is None else world
    crashes = runs = 0
    load = scenario.load
    argvs: list[tuple[str, ...]] = []
    degraded: str | None = None
    for run_no in range(1, max_runs + 1):
        runs = run_no
        flags = loop.flags
        argv = loop.start_pod(run_no)
        argvs.append(tuple(argv))
        run = play(argv)
        loop.now += STARTUP_SECONDS
        if run.ready:
            loop.pod_ready()
            loop.operator_pass(run.idle_free, run.startup_min_free, run.startup_free)
            if loop.rolled:
                continue  # rolled before the load arrives
        if run.crashed:
            crashes += 1
            if run.ready:
                loop.now += load.idle_seconds + load.ramp_seconds
            loop.trace.append(f"t+{loop.now - T0:.0f}s run {run_no} crashed: {_crash_text(run.outcome)}")
            restarts = 1
            loop.pod_crashed(run, restarts)
            d = loop.operator_pass()  # a crashed pod is not Ready: nothing to scrape
            while d.action == "hold" and d.retry_after is not None:
                # the kubelet keeps restarting the container under the same flags meanwhile
                more = crashloop_restarts(d.retry_after, STARTUP_SECONDS)
                crashes += more
                restarts += more
                loop.now += d.retry_after
                loop.pod_crashed(run, restarts)
                d = loop.operator_pass()
            if not loop.rolled:
                if d.action != "hold":
                    loop.note(d)
                degraded = d.reason if d.action == "degrade" else None
                break  # degraded: the operator has nothing left to change
            continue
        # Survived a full load cycle. The agent's 60 s window covers a whole cycle, so every
        # later scrape shows the cycle's minimum; keep passing until the operator has had its say.
        assert run.cycle_min_free is not None
        low = run.cycle_min_free
        loop.now += load.cycle_seconds
        survived_at = loop.now
        while loop.now - survived_at <= SETTLE_SECONDS:
            loop.operator_pass(run.idle_free, low, run.startup_free)
            if loop.rolled:
                break
            loop.now += PASS_SECONDS
        if loop.rolled:
            continue
        bottleneck = min(range(scenario.world_size), key=lambda r: (low[r], r))
        loop.trace.append(
            f"t+{survived_at - T0:.0f}s run {run_no} survived the load with {run.outcome.num_gpu_blocks:,} "
            f"blocks (rank {bottleneck} kept {low[bottleneck] / GIB:.2f} GiB free at the peak); no change "
            f"in the next {SETTLE_SECONDS / 60:.0f} min"
        )
        return StrategyResult(
            strategy="rankguard",
            stable=True,
            crashes=crashes,
            runs=run_no,
            num_gpu_blocks=run.outcome.num_gpu_blocks,
            capacity=_share(run.outcome.num_gpu_blocks, truth),
            final_flags=describe_flags(flags),
            trace=tuple(loop.trace),
            final_argv=tuple(argv),
            argvs=tuple(argvs),
        )
    return StrategyResult(
        strategy="rankguard",
        stable=False,
        crashes=crashes,
        runs=runs,
        num_gpu_blocks=0,
        capacity=None,
        final_flags=describe_flags(loop.flags),
        trace=tuple(loop.trace),
        argvs=tuple(argvs),
        degraded=degraded,
    )


# ---------------------------------------------------------------------------------------------
# All of them on one scenario


def compare(name: str) -> ScenarioComparison:
    scenario = load_scenario(name)
    truth = true_max_safe_kv(scenario)
    config = engine_config(scenario, utilization_argv(scenario, VLLM_DEFAULT_UTILIZATION))
    block_bytes = min(r.block_bytes for r in rank_memory(scenario, config))
    return ScenarioComparison(
        scenario=name,
        truth=truth,
        block_bytes=block_bytes,
        default=simulate_utilization(scenario, truth, step=0.0, name="vllm-default"),
        human=simulate_utilization(scenario, truth, step=HUMAN_STEP, name="human"),
        rankguard=simulate_rankguard(scenario, truth),
        rankguard_no_probe=simulate_rankguard(scenario, truth, probe=False),
    )
