"""The simulated world the three KV strategies of bench/compare_strategies.py run against.

Which scenarios are compared (and why the others are not); one run of a `vllm serve` command
line on a scenario, with what an agent on each GPU would see; the LLMService spec rankguard is
given for a scenario; and what the cluster reports about a run: the agent's /report, the pod
the Deployment controller makes from a template, its termination as the agent's recognisers
and the kubelet write it, the Deployment controller's status, the kubelet's crash-loop back-off.

Held apart from the runner (strategies_runner.py) so that what the world does is read in one
place, and the operator's side never reaches it except through these API-shaped reports. The
world is `rankguard_sim.physics.engine_memory` over the scenario files, the same memory model
the fake vLLM executes.

Deterministic and pure: no clock, no I/O.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_agent import verdict as agent_verdict
from rankguard_agent.launcher import Observer
from rankguard_agent.sampler import DEFAULT_WINDOW_SECONDS
from rankguard_agent.wire.report import (
    REPORT_VERSION,
    EngineMemory,
    ProbeRank,
    ProbeResult,
    RankSample,
    Report,
    parse_report,
)
from rankguard_agent.wire.termination import TerminationMessage
from rankguard_agent.workers import WorkerRanks, parallel_sizes
from rankguard_operator.core.names import VLLM_CONTAINER
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.units import iso
from rankguard_sim.fake_vllm.args import engine_config_from_argv
from rankguard_sim.fake_vllm.console import Console, failure_lines, worker_name
from rankguard_sim.physics.engine_config import EngineConfig
from rankguard_sim.physics.engine_failures import EngineFailure
from rankguard_sim.physics.engine_memory import EngineMemoryModel, KVPlan, PureLedger
from rankguard_sim.physics.engine_outcome import Outcome, outcome_for_config
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.vllm_snapshot import format_gib, message, where

# The scenarios whose failure is GPU memory. host-oomkilled fails on HOST memory (the
# container's cgroup limit); its GPU never runs out at any of these utilisations, so "OOM
# crashes until stable" and "KV kept" say nothing about it (the e2e test covers its fix).
GPU_SCENARIOS = ("llama3-70b-tp4", "llama3-70b-tp8-nvls", "tp2-pp2", "llama3-8b-tp2-24gb")
# The phase scenarios of issue 27 (each OOM in one phase of vLLM's start-up or serving, each
# answered by its own lever): compared in a table of their own (strategies_phases.py), since the
# utilisation strategies above do not tell the levers apart.
PHASE_SCENARIOS = (
    "oom-weights",
    "oom-profile",
    "oom-kv-allocation",
    "oom-cuda-graphs",
    "oom-cuda-graphs-eager",
    "oom-sampler-warmup",
    "oom-serving",
)
SKIPPED = {
    "llama3-70b-tp8-pp2-2nodes": (
        "a multi-node group (vLLM --nnodes over two pods); this table runs one pod per replica (the "
        "vLLM 0.34 table runs it as one two-pod group, bench/strategies_group.py)"
    ),
    "host-oomkilled": (
        "its failure is a host-memory OOMKill at the container limit, not GPU memory: no GPU ever "
        "runs out, so the three KV strategies do not differ in crashes (rankguard's fix there is "
        "raising the memory limit, as tests/e2e/test_loop.py::"
        "test_oomkilled_raises_the_memory_limit_until_running shows)"
    ),
    "support-70b-tp4": (
        "it is llama3-70b-tp4's world under a private model name (the fine-tune no catalog knows, "
        "for tests/e2e/test_models.py): its row would repeat llama3-70b-tp4's"
    ),
}


# ---------------------------------------------------------------------------------------------
# The world: one run of a `vllm serve` command line, with what an agent on each GPU would see


@dataclass(frozen=True)
class WorldRun:
    outcome: Outcome  # the world's verdict (engine_outcome.outcome_for_config)
    ready: bool  # start-up finished: /health answers and the operator scrapes the agent
    idle_free: tuple[int, ...]  # per rank, free memory once started (before the load)
    startup_min_free: tuple[int, ...]  # per rank, the lowest free memory during start-up
    cycle_min_free: tuple[int, ...] | None  # the lowest over start-up and a full load cycle
    # what the fake vLLM prints when the engine fails (`printed_failure`), as the agent reads it
    failure_lines: tuple[str, ...] = ()
    # per rank, the free memory vLLM's worker measured at start-up, which it prints (the memory
    # report, or with a byte budget the "Initial free memory" line) and the agent reports
    startup_free: tuple[int, ...] = ()
    argv: tuple[str, ...] = ()  # the `vllm` command line of the run (what the launcher runs)
    # per rank, the free memory at the engine's init snapshot and other processes' memory then:
    # what the agent's sampler keeps when the worker starts loading weights (free_at_load /
    # others_at_load) and writes with a CUDA OOM; empty where the run does not say
    snapshot_free: tuple[int, ...] = ()
    others_at_start: tuple[int, ...] = ()
    others_peak: tuple[int, ...] = ()  # per rank, the most others held during the run

    @property
    def crashed(self) -> bool:
        return self.outcome.crashes


class _WatchedLedger(PureLedger):
    """A pure ledger that remembers each GPU's lowest free memory, as the agent's sampler does."""

    def __init__(self, totals: Sequence[int]) -> None:
        super().__init__(totals)
        self.low = list(totals)

    def hold(self, rank: int, tag: str, nbytes: int) -> None:
        super().hold(rank, tag, nbytes)
        self.low[rank] = min(self.low[rank], self.free(rank))


class _ReplayConsole(Console):
    """The fake vLLM's console with a fixed time stamp, so that the bench stays deterministic."""

    @staticmethod
    def stamp() -> str:
        return "01-01 00:00:00"


def printed_failure(
    scenario: Scenario, failure: EngineFailure, *, at_startup: bool, plan: KVPlan | None = None
) -> tuple[str, ...]:
    """What the fake vLLM prints when its engine fails (fake_vllm/main.py `report_failure`, one
    node): each worker's "Available KV cache memory" when the failure came after vLLM sized the
    KV cache by a utilisation (`plan`; the agent keeps it for the operator), then the failing
    worker's traceback under that worker's log prefix, then the engine core's end. The phase
    markers the fake prints before (wire/phases.py MARKERS) are not replayed: the traceback's
    frames name the phase, and the agent lets them win over any marker."""
    out = io.StringIO()
    console = _ReplayConsole(pid=1, out=out, err=out)
    if plan is not None and not plan.pinned:
        for rank, avail in enumerate(plan.available):
            console.info(
                worker_name(scenario, rank),
                where("available_kv_memory"),
                message("available_kv_memory", format_gib(avail)),
            )
    who = "EngineCore_DP0" if failure.rank is None else worker_name(scenario, failure.rank)
    where_from = "core.py:718" if scenario.world_size == 1 else "multiproc_executor.py:671"
    lines = failure_lines(failure)
    first = "WorkerProc failed to start." if at_startup else "WorkerProc hit an exception."
    console.error_lines(who, where_from, [first, *lines])
    if at_startup:
        console.engine_failed_to_start([lines[-1]])
    else:
        console.engine_died(
            f"RuntimeError: Worker failed with error '{failure.message()}', "
            "please check the stack trace above for the root cause"
        )
    return tuple(out.getvalue().splitlines())


def engine_config(scenario: Scenario, argv: Sequence[str]) -> EngineConfig:
    """What `vllm serve ARGV` configures on this scenario: the fake vLLM's own parser and
    resolution, with none of vLLM's environment switches set (the rendered pod sets none)."""
    return engine_config_from_argv(scenario, argv, env={})


def utilization_argv(scenario: Scenario, utilization: float) -> list[str]:
    """What a person runs: the model, its split, and a utilisation; vLLM's defaults for the rest."""
    argv = ["serve", scenario.model.name, "--tensor-parallel-size", str(scenario.tensor_parallel_size)]
    if scenario.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(scenario.pipeline_parallel_size)]
    return [*argv, "--gpu-memory-utilization", repr(utilization)]


def run_world(scenario: Scenario, argv: Sequence[str]) -> WorldRun:
    """Start `vllm serve ARGV` on empty GPUs and walk one full load cycle, as the fake vLLM does.

    The verdict is the world's own `outcome_for_config()`. The per-rank free figures come from
    replaying the same `EngineMemoryModel` over a ledger that keeps each GPU's minimum, and the
    two must agree (they are the same model; a disagreement is a bug in this benchmark).
    """
    config = engine_config(scenario, argv)
    verdict = outcome_for_config(scenario, config)
    ranks = range(scenario.world_size)
    ledger = _WatchedLedger([scenario.gpu.total_bytes] * scenario.world_size)
    engine = EngineMemoryModel(scenario, config, ledger)
    failure: EngineFailure | None = None
    ready = False
    idle: tuple[int, ...] = ()
    startup_low: tuple[int, ...] = ()
    cycle_low: tuple[int, ...] | None = None
    try:
        engine.startup()
        ready = True
        idle = tuple(ledger.free(r) for r in ranks)
        startup_low = tuple(ledger.low)
        for running in engine.running_levels():
            engine.begin_step(running)
            engine.end_step()
        cycle_low = tuple(ledger.low)
    except EngineFailure as exc:
        failure = exc
    if (failure is not None) != verdict.crashes or (failure is not None and failure.rank != verdict.rank):
        raise AssertionError(
            f"{scenario.name}: replay disagrees with outcome_for_config() ({failure!r} vs {verdict})"
        )
    return WorldRun(
        outcome=verdict,
        ready=ready,
        idle_free=idle,
        startup_min_free=startup_low,
        cycle_min_free=cycle_low,
        failure_lines=printed_failure(scenario, failure, at_startup=not ready, plan=engine.plan)
        if failure is not None
        else (),
        startup_free=tuple(engine.snapshot_free) if ready else (),
        argv=tuple(argv),
    )


# ---------------------------------------------------------------------------------------------
# What rankguard is given for a scenario, and what its agent reports


def spec_for(scenario: Scenario, *, probe: bool = True) -> dict[str, Any]:
    """An LLMService spec for the scenario, with the engine flags at the scenario's defaults and
    the GPU size given, so rankguard can plan before the first pod runs."""
    d = scenario.defaults
    return {
        "agent": {"probe": probe},
        "model": {"name": scenario.model.name},
        "image": "vllm/vllm-openai:v0.33.0",
        "tensorParallelSize": scenario.tensor_parallel_size,
        "pipelineParallelSize": scenario.pipeline_parallel_size,
        "engine": {
            "maxNumSeqs": d.max_num_seqs,
            "maxNumBatchedTokens": d.max_num_batched_tokens,
            "maxModelLen": scenario.model.max_position_embeddings,
            "blockSize": d.block_size,
            "logitsMode": "gather" if scenario.logits.mode == "gather" else "all-gather",
        },
        "memory": {"gpuMemoryBytes": scenario.gpu.total_bytes},
    }


def agent_report(
    scenario: Scenario,
    free: Sequence[int],
    min_free: Sequence[int],
    now: float,
    *,
    probe: bool = True,
    startup_free: Sequence[int] = (),
) -> Report:
    """The agent's /report for one pod: per-rank memory now and its window minimum, the probe's
    free memory after CUDA context + NCCL init (what that init costs in this world), and the
    free memory each vLLM worker printed at its start-up (`startup_free`, when it got there).
    Round-tripped through JSON and `parse_report`, as the operator receives it."""
    total = scenario.gpu.total_bytes
    report = Report(
        version=REPORT_VERSION,
        agent_version="bench",
        timestamp=now,
        ranks=[
            RankSample(
                rank=r,
                uuid=f"GPU-{scenario.name}-{r}",
                total_bytes=total,
                used_bytes=total - free[r],
                free_bytes=free[r],
                min_free_bytes=min(min_free[r], free[r]),
                window_seconds=DEFAULT_WINDOW_SECONDS,
                engine_memory=EngineMemory(free_at_start_bytes=startup_free[r]) if startup_free else None,
            )
            for r in range(scenario.world_size)
        ],
        probe=None
        if not probe
        else ProbeResult(
            ok=True,
            backend="nccl",
            world_size=scenario.world_size,
            ranks=[
                ProbeRank(
                    rank=r,
                    free_before_bytes=total,
                    free_after_bytes=total - scenario.comm_init_bytes(r),
                    comm_bytes=scenario.comm_init_bytes(r),
                )
                for r in range(scenario.world_size)
            ],
        ),
    )
    return parse_report(report.to_json())


# ---------------------------------------------------------------------------------------------
# The cluster's side: the pod, its termination, the Deployment controller's status


def termination_message(run: WorldRun, n_ranks: int) -> TerminationMessage:
    """What the agent's launcher writes when the engine dies: it scans the engine's output with
    its recognisers, the worker prefixes read for the ranks of the run's command line
    (rankguard_agent.launcher.Launcher.run), and maps the exit to its JSON termination message,
    with the phase the failing rank was in (wire/phases.py)."""
    seen = Observer(None, WorkerRanks(parallel_sizes(run.argv), n_ranks))
    for line in run.failure_lines:
        seen.on_line(line)
    return agent_verdict.termination_message(
        1,
        seen.cause,
        seen.last_kv,
        n_ranks,
        last_error=seen.last_error,
        cause_rank=seen.cause_rank,
        phase=seen.cause_phase,
        at_load=lambda r: _at_load(run, r),
    )


def _at_load(run: WorldRun, rank: int) -> tuple[int | None, int | None, int | None]:
    """What the agent's sampler would hold for `rank` when the engine died: the free memory and
    others' memory at the engine's snapshot, and others' peak since (the run's last figures)."""
    free = run.snapshot_free[rank] if rank < len(run.snapshot_free) else None
    held = run.others_at_start[rank] if rank < len(run.others_at_start) else None
    peak = run.others_peak[rank] if rank < len(run.others_peak) else held
    return free, held, peak


def _ready_condition(ready: bool) -> dict[str, str]:
    return {"type": "Ready", "status": "True" if ready else "False"}


def new_pod(deployment: Mapping[str, Any], name: str, uid: str, ip: str) -> dict[str, Any]:
    """The pod the Deployment controller makes from the template the Deployment holds (its
    annotations carry the template hash and the serving flags), started, not Ready yet."""
    template = deployment["spec"]["template"]
    meta = template["metadata"]
    return {
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
        },
        "spec": template["spec"],
        "status": {
            "podIP": ip,
            "conditions": [_ready_condition(False)],
            "containerStatuses": [
                {"name": VLLM_CONTAINER, "ready": False, "restartCount": 0, "state": {"running": {}}}
            ],
        },
    }


def with_ready(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The pod once vLLM answers /health: Ready."""
    status = pod["status"]
    statuses = [{**c, "ready": True} for c in status["containerStatuses"]]
    return {
        **pod,
        "status": {**status, "conditions": [_ready_condition(True)], "containerStatuses": statuses},
    }


def crashed(
    pod: Mapping[str, Any], run: WorldRun, *, restarts: int, now: float, n_ranks: int
) -> dict[str, Any]:
    """The pod after its vLLM container died `restarts` times (the kubelet backing off): not
    Ready, the last run's end in lastState, its message the agent's JSON termination message."""
    message = termination_message(run, n_ranks)
    container = {
        "name": VLLM_CONTAINER,
        "ready": False,
        "restartCount": restarts,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {
            "terminated": {
                "exitCode": message.exit_code,
                "reason": "Error",
                "message": message.to_json(),
                "finishedAt": iso(now),
            }
        },
    }
    status = {**pod["status"], "conditions": [_ready_condition(False)], "containerStatuses": [container]}
    return {**pod, "status": status}


def pod_argv(pod: Mapping[str, Any]) -> list[str]:
    """The `vllm` command line the pod runs: its vLLM container's command after the agent's
    launcher (`python3 -m rankguard_agent launch … -- vllm ARGS`)."""
    return served_argv(pod["spec"])


def deployment_status(deployment: Mapping[str, Any], *, ready: bool) -> dict[str, int]:
    """The Deployment controller's status once the pod of the current template exists:
    generation observed, every replica updated, ready and available when the pod is Ready.
    (One pod: `spec_for` asks for one replica.)"""
    replicas = int(deployment["spec"]["replicas"])
    up = replicas if ready else 0
    return {
        "observedGeneration": int(deployment["metadata"]["generation"]),
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": up,
        "availableReplicas": up,
    }


# The kubelet's CrashLoopBackOff: 10 s, doubling, capped at 5 min.
BACKOFF_START_SECONDS = 10.0
BACKOFF_CAP_SECONDS = 300.0


def crashloop_restarts(wait_seconds: float, run_seconds: float) -> int:
    """Restarts the kubelet makes of a crashing container within `wait_seconds` (each crashes)."""
    backoff, t, n = BACKOFF_START_SECONDS, 0.0, 0
    while True:
        t += backoff + run_seconds
        if t > wait_seconds:
            return n
        n += 1
        backoff = min(2 * backoff, BACKOFF_CAP_SECONDS)
