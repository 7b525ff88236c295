"""Keeping KV capacity without crashing: three ways to size vLLM's KV cache, compared.

For each built-in GPU scenario, three strategies run the serving setup again and again in the
simulated world until one run survives the scenario's whole load pattern:

  (a) vLLM's default --gpu-memory-utilization 0.92, never changed: a setup that crashes at
      0.92 crash-loops forever;
  (b) a person lowering --gpu-memory-utilization by 0.05 after every OOM, from 0.92;
  (c) rankguard: the operator's own reconcile step
      (`rankguard_operator.core.step.reconcile.step`), one call per operator pass, on what the
      edge would hand it: the LLMService's spec and status, the Deployment it applied (with a
      Deployment controller's status), the pod made from that Deployment's template (its
      termination built from the engine's printed failure by the agent's own recognisers, with
      the engine phase the failing rank was in, in the kubelet's status shape), and agent
      reports whose per-rank figures come from the world (its probe cost after NCCL init and
      its free memory, replayed phase by phase). The step's
      effects are carried out on those objects by the operator's own in-memory replay
      (`rankguard_operator.core.step.Objects`), and the next pass starts from the status as
      the API server would store it.

A second table compares three ways to answer an OOM on the phase scenarios of issue 27 (each
OOM in one phase of vLLM's start-up or serving, each fixed by its own lever): rankguard's
reconcile step, rankguard's rule before issue 27 (every CUDA OOM cuts the KV budget) and a
person's recipe (halve the utilisation, then --enforce-eager); see strategies_phases.py.

A third table (issue 49) compares vanilla vLLM 0.34, which sizes its KV cache itself after
warm-up (utilisation unset), with rankguard on 0.34 (the same reconcile step for a 0.34 image:
engine-measured mode, a reserve through --gpu-memory-utilization from the agents' outside-memory
figures, pinned where the engine cannot measure) on clean GPUs (TP4, TP8, TP8×PP2 over two pods),
a neighbour growing on GPU 0, a KV connector's device buffers and a node without VMM; see
strategies_measured.py (the world of a case, the agent's 0.34 report), strategies_group.py (a
two-pod group) and strategies_measured_compare.py (the strategies, the table).

Every run starts the engine from a `vllm serve` command line, resolved by the fake vLLM's own
parser (`rankguard_sim.fake_vllm.args.engine_config_from_argv`); rankguard's runs take theirs
from the pod, i.e. from the Deployment the step rendered.

Each strategy reports the OOM crashes until stable and the KV capacity it keeps, in KV
blocks, as a share of the world's true maximum safe capacity
(`rankguard_sim.physics.engine_outcome.true_max_safe_kv`). The world is
`rankguard_sim.physics.engine_memory` over the scenario files
(`rankguard_sim.physics.scenario_file`), the same memory model the fake vLLM executes; the
operator never sees it except through the figures an agent and a kubelet would report.

    .venv/bin/python bench/compare_strategies.py [--scenario NAME ...] [--case NAME ...] [--late-sidecar]
        [--no-trace]

A fourth table (issue 50) is a group drill: a sidecar in the worker pod of a TP8×PP2 service
over two pods loads onto rank 12's GPU after vLLM's memory snapshot, so the first start dies
allocating the KV cache; it counts the remediations and whole-group rolls rankguard takes for
that one cause (strategies_late_sidecar.py; `--late-sidecar` runs it alone).

This file is the entry point; the benchmark is the modules beside it, one per
responsibility: strategies_world.py (the scenarios compared, a run of the world, the spec
rankguard is given, what the agent and the kubelet report), strategies_loop.py (rankguard's loop
over the operator's reconcile step), strategies_runner.py (the strategies run against that
world: the two utilisation baselines and rankguard's runs), strategies_table.py (the table,
notes and trace printed), strategies_phases.py (the per-phase comparison and its table) and the
three vLLM 0.34 modules above.

Deterministic and pure (no clock, no I/O but stdout); exits 0 unless something raises.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rankguard_sim.physics.scenario_file import builtin_names
from strategies_late_sidecar import SIDECAR_SIZES, drill, render_late_sidecar
from strategies_measured import CASES
from strategies_measured_compare import compare_measured, render_measured
from strategies_phases import compare_phase, render_phases
from strategies_runner import compare
from strategies_table import render
from strategies_world import GPU_SCENARIOS, PHASE_SCENARIOS, SKIPPED


def main(argv: Sequence[str] | None = None) -> int:
    # The agent's launcher warns about every OOM line it sees, which is its job inside a pod;
    # here those OOMs are the subject of the table, so the warnings would only repeat it.
    logging.getLogger("rankguard_agent").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--scenario",
        action="append",
        choices=[n for n in builtin_names() if n not in SKIPPED],
        help="a scenario to compare (repeatable); default: all of "
        + ", ".join((*GPU_SCENARIOS, *PHASE_SCENARIOS)),
    )
    parser.add_argument(
        "--case",
        action="append",
        choices=[c.name for c in CASES],
        help="a vLLM 0.34 case (repeatable); default: all of them, unless --scenario is given",
    )
    parser.add_argument(
        "--late-sidecar",
        action="store_true",
        help="the late-sidecar group drill (issue 50); default: run, unless --scenario or --case is given",
    )
    parser.add_argument("--no-trace", action="store_true", help="print the tables and notes only")
    opts = parser.parse_args(argv)
    chosen = bool(opts.scenario or opts.case or opts.late_sidecar)
    names = opts.scenario or ([] if chosen else [*GPU_SCENARIOS, *PHASE_SCENARIOS])
    cases = [c for c in CASES if c.name in opts.case] if opts.case else ([] if chosen else list(CASES))
    drills = [drill(n) for n in SIDECAR_SIZES] if opts.late_sidecar or not chosen else []
    rows = [compare(n) for n in names if n not in PHASE_SCENARIOS]
    phase_rows = [compare_phase(n) for n in names if n in PHASE_SCENARIOS]
    measured_rows = [compare_measured(c) for c in cases]
    out = []
    if rows:
        out.append(render(rows, traces=not opts.no_trace))
    if phase_rows:
        out.append("Per OOM phase (issue 27):\n\n" + render_phases(phase_rows, traces=not opts.no_trace))
    if measured_rows:
        out.append(
            "vLLM 0.34, which sizes its KV cache after warm-up (issue 49):\n\n"
            + render_measured(measured_rows, traces=not opts.no_trace)
        )
    if drills:
        out.append(
            "A late sidecar on rank 12 of a TP8×PP2 group (issue 50):\n\n"
            + render_late_sidecar(drills, traces=not opts.no_trace)
        )
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
