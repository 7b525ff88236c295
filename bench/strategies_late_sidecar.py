"""A late sidecar on a worker's rank of a TP8×PP2 group (issue 50): how many whole-group rolls
one cause costs.

The world is the llama3-70b-tp8-pp2-2nodes scenario (vLLM 0.33, Llama-3.1-70B over two pods of
eight H100 80 GB cards) with one more process: a sidecar in the worker pod that loads onto the GPU
of global rank 12 (the worker's local GPU 4, pipeline stage 1) after the workers' memory snapshot
and before the KV cache is allocated (a `late_other_process` component, the same phase as the
oom-kv-allocation scenario's embedding sidecar). vLLM's budget never saw it, so the first start
dies allocating the KV cache on rank 12, and the whole group goes down with it.

rankguard is the operator's own reconcile step over the two StatefulSets it renders
(strategies_group.GroupLoop: the bench plays their controller and the kubelets), the agents
reporting what a vLLM 0.33 agent reports (strategies_world.agent_report, each pod its own eight
ranks). Before issue 50 the first cut took the deficit and the 512 MiB safety margin only: the
CUDA-graph pool (512 MiB in this world) is captured after the KV cache out of what the cut left,
so the next start failed at capture by a few MiB, its cut then left nothing for the NCCL memory
the first pipeline traffic creates on the last stage, and low headroom took one more: four
remediations, four rolls of the whole group. Now the first cut also leaves the room the plan
says start-up and serving take after the KV cache (budget.bounds.after_kv_bytes).

Pure and deterministic (simulated time, no I/O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_agent.wire.report import Report
from rankguard_sim.physics.engine_outcome import true_max_safe_kv
from rankguard_sim.physics.scenario_data import GIB, Component, Scenario
from rankguard_sim.physics.scenario_file import load_scenario
from strategies_group import GroupLoop, group_spec
from strategies_loop import RankguardLoop
from strategies_measured import MeasuredCase, MeasuredLoop
from strategies_runner import StrategyResult, simulate_rankguard
from strategies_world import WorldRun, run_world, spec_for

SCENARIO = "llama3-70b-tp8-pp2-2nodes"
SIDECAR_RANK = 12  # the worker pod's local GPU 4: pipeline stage 1, TP rank 4
# Sidecars large enough that the planned budget's first start dies allocating the KV cache (a
# smaller one leaves the plan's serving headroom short instead, which is not this drill)
SIDECAR_SIZES = (14 * GIB, 20 * GIB)


def late_sidecar_scenario(nbytes: int) -> Scenario:
    """The group's world with the sidecar on rank 12, taken after vLLM's memory snapshot."""
    base = load_scenario(SCENARIO)
    sidecar = Component(
        name="late_sidecar",
        phase="late_other_process",
        default_bytes=0,
        rank_bytes={SIDECAR_RANK: nbytes},
        source="issue 50's drill: a sidecar in the worker pod that loads onto rank 12's GPU late",
    )
    return dataclasses.replace(base, components=(*base.components, sidecar))


class _Agent033(MeasuredLoop):
    """A vLLM 0.33 agent's report (no 0.34 warm-up lines, no engine-measured sizing)."""

    def report(
        self,
        free: Sequence[int],
        min_free: Sequence[int],
        startup_free: Sequence[int],
        *,
        probe: bool,
        pod: str,
    ) -> Report:
        return RankguardLoop.report(self, free, min_free, startup_free, probe=probe, pod=pod)


class LateSidecarLoop(GroupLoop, _Agent033):
    """GroupLoop (two StatefulSets, each pod's agent its own ranks) over the 0.33 agent."""

    def __init__(self, scenario: Scenario, spec_doc: dict[str, Any]) -> None:
        self.pods: list[dict[str, Any]] = []
        self.case = MeasuredCase("late-sidecar", scenario.name)
        self.last = None
        RankguardLoop.__init__(self, scenario, spec_doc=group_spec(spec_doc))


@dataclass(frozen=True)
class LateSidecarDrill:
    sidecar_bytes: int
    truth_blocks: int  # the world's true maximum safe KV, in blocks (sidecar included)
    result: StrategyResult
    triggers: tuple[str, ...]  # each change status.remediations recorded, by its trigger
    rolls_to_serve: int  # group rolls before the first start that survived the load

    @property
    def remediations(self) -> int:
        return len(self.triggers)

    @property
    def group_rolls(self) -> int:
        """Every start after the first replaces both pods of the group."""
        return self.result.rolls


def drill(nbytes: int) -> LateSidecarDrill:
    scenario = late_sidecar_scenario(nbytes)
    truth = true_max_safe_kv(scenario)
    loop = LateSidecarLoop(scenario, spec_for(scenario))
    runs: list[WorldRun] = []

    def play(argv: Sequence[str]) -> WorldRun:
        run = run_world(scenario, argv)
        runs.append(run)
        return run

    result = simulate_rankguard(scenario, truth, loop=loop, world=play)
    triggers = tuple(str(r.get("trigger")) for r in loop.objects.status.get("remediations") or [])
    serving = next((i for i, r in enumerate(runs) if not r.crashed), len(runs))
    return LateSidecarDrill(nbytes, truth.num_gpu_blocks, result, triggers, serving)


def render_late_sidecar(rows: Sequence[LateSidecarDrill], *, traces: bool = True) -> str:
    lines = [
        "| sidecar on rank 12 | OOM crashes | group rolls until it serves | remediations (triggers) "
        "| group rolls in all | KV kept (% of true max) | final |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in rows:
        r = d.result
        kept = (
            f"{r.num_gpu_blocks:,} blocks ({100 * (r.capacity or 0):.1f} %)" if r.stable else "never stable"
        )
        lines.append(
            f"| {d.sidecar_bytes / GIB:.0f} GiB | {r.crashes} | {d.rolls_to_serve} | {d.remediations} "
            f"({', '.join(d.triggers)}) | {d.group_rolls} | {kept} | {r.final_flags} |"
        )
    out = "\n".join(lines)
    if traces:
        for d in rows:
            out += f"\n\nrankguard, sidecar {d.sidecar_bytes / GIB:.0f} GiB:\n" + "\n".join(
                f"  {t}" for t in d.result.trace
            )
    return out
