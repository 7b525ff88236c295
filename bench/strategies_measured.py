"""vLLM 0.34 (issue 49): the world of a case, with what vLLM cannot see, and what its agent reports.

vLLM 0.34 sizes its KV cache itself after warm-up and CUDA-graph capture (its "extensible KV
cache", physics/engine_measured.py). strategies_measured_compare.py runs two strategies on each
case until one run survives the scenario's whole load: vanilla 0.34 (`vanilla_argv`: the
utilisation unset, restarted unchanged) and rankguard (the operator's own reconcile step for the
service `measured_spec` gives, image vllm/vllm-openai:v0.34.0, over a `MeasuredLoop` whose agents
report what a 0.34 agent reports: `measured_report`).

The world of a case (`run_measured`) is the 0.34 engine of the sim (`vllm_snapshot.playing`) over
a pure ledger, plus what the case puts beside it, modelled here in the run of the world:

* a neighbour (`Neighbour`): another process on one GPU, outside the pod, holding `hold` bytes
  from before the engine starts and growing by `grow` bytes once the load reaches ramp level
  `at_level`. Like rankguard_sim.physics.neighbour's process it never takes more than the GPU has
  free: what it cannot get yet it takes once the engine has died, so later runs meet it grown.
  The agent reports it as `others` (NVML's process list: not the pod's process tree).
* a KV connector's device buffers (`connector_bytes` per GPU): vLLM creates the connector in
  `extend_kv_cache`, after the measurement and after torch's cap is set, so the world allocates
  them right after the KV cache is committed, as a driver allocation beside the KV cache (outside
  torch's caching allocator, so not under its cap: what they take is missing from the free memory
  the serving transients need). They are the engine process's own memory: never "others". The
  world allocates them only when the command line configures a connector (--kv-transfer-config).
* a node without virtual memory management (`vmm=False`): vLLM's engine core turns the
  measurement off and sizes from the profile's estimate at 0.92 unless a utilisation is given
  (fake_vllm/startup.fall_back, replayed here); the agent reports `vmm: false` and the engine's
  `extensible_kv_disabled` reason.

The true fit of a case is what vLLM 0.34's own sizing keeps when nothing surprises it: the same
engine, utilisation unset, with the neighbour already at its peak and the connector's buffers
already held when it measures (`run_measured(..., foreseen=True)`; used by
strategies_measured_compare.true_fit); without VMM it is the world's physical bound
(engine_outcome.true_max_safe_kv), which pinned mode is scored against today. Every row also
gives the share of that physical bound.

A two-pod group (TP8×PP2 over two pods) is played by the world in one process (one ledger over
its 16 GPUs, vLLM's minimum spanning both pods); strategies_group.py plays its StatefulSets.

Pure and deterministic (simulated time, no I/O).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rankguard_agent.wire.report import Report, parse_report
from rankguard_agent.wire.report_memory import OtherProcess, WarmupMemory
from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.fake_vllm.startup import NO_VMM_REASON
from rankguard_sim.physics.engine_config import EngineConfig
from rankguard_sim.physics.engine_failures import EngineFailure
from rankguard_sim.physics.engine_measured import PHASE_EXTEND, MeasuredEngineModel, engine_model
from rankguard_sim.physics.engine_memory import EngineMemoryModel
from rankguard_sim.physics.engine_outcome import Outcome, outcome_for_config
from rankguard_sim.physics.scenario_data import GIB, Scenario
from rankguard_sim.physics.scenario_file import load_scenario
from rankguard_sim.vllm_snapshot import extensible_facts, playing
from strategies_loop import RankguardLoop
from strategies_world import (
    WorldRun,
    _WatchedLedger,
    agent_report,
    engine_config,
    printed_failure,
    spec_for,
    utilization_argv,
)

VERSION = "0.34.0"
IMAGE = f"vllm/vllm-openai:v{VERSION}"
TAG_CONNECTOR = "kv_connector"  # the ledger tag of a connector's device buffers
NEIGHBOUR_PID, NEIGHBOUR_NAME = 4242, "python3"  # how the agent names the neighbour (NVML + /proc)
# The connector of the connector case: LMCache's v1 connector records no KV-cache access flags in
# 0.34 (engine.json `connectors`), so vLLM keeps measuring with it and rankguard stays engine-measured.
CONNECTOR = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
KEEP_SHARE = 0.995  # clean GPUs: rankguard keeps >= 99.5 % of vanilla 0.34's KV tokens
FIT_SHARE = 0.97  # neighbour / connector: >= 97 % of the true fit, 0 OOMs after the first


@dataclass(frozen=True)
class Neighbour:
    gpu: int  # the GPU (the world's ledger index: global rank on one node)
    hold: int  # held before the engine starts
    grow: int  # added once the load reaches `at_level`
    at_level: int = 0  # the ramp level (index into the engine's running levels)


@dataclass(frozen=True)
class MeasuredCase:
    name: str
    scenario: str
    neighbour: Neighbour | None = None
    connector_bytes: int = 0  # per GPU, allocated by the engine after the measurement
    vmm: bool = True
    what: str = ""

    @property
    def clean(self) -> bool:
        return self.neighbour is None and not self.connector_bytes and self.vmm


CASES = (
    MeasuredCase("clean-tp4", "llama3-70b-tp4", what="clean GPUs, TP4"),
    MeasuredCase("clean-tp8", "llama3-70b-tp8-nvls", what="clean GPUs, TP8"),
    MeasuredCase("clean-tp8-pp2", "llama3-70b-tp8-pp2-2nodes", what="clean GPUs, TP8×PP2 over two pods"),
    MeasuredCase(
        "neighbour-tp4",
        "llama3-70b-tp4",
        neighbour=Neighbour(gpu=0, hold=2 * GIB, grow=6 * GIB),
        what="TP4; a neighbour on GPU 0 holds 2 GiB, grows 6 GiB once the load starts",
    ),
    MeasuredCase(
        "connector-tp4",
        "llama3-70b-tp4",
        connector_bytes=2 * GIB,
        what="TP4; a KV connector (LMCacheConnectorV1) with 2 GiB of device buffers per GPU",
    ),
    MeasuredCase("no-vmm-tp4", "llama3-70b-tp4", vmm=False, what="TP4 on a node without VMM"),
)


# ---------------------------------------------------------------------------------------------
# The world of a case


class _NeighbourLedger(_WatchedLedger):
    """The pure ledger with a neighbour's bytes as other processes' memory (NVML's used)."""

    def __init__(self, totals: Sequence[int], neighbour: Sequence[int]) -> None:
        super().__init__(totals)
        self.others_used = list(neighbour)
        self.low = [t - n for t, n in zip(totals, neighbour, strict=True)]

    def grow(self, gpu: int, nbytes: int) -> int:
        """The neighbour asks for `nbytes` more; it gets what is free now (returned)."""
        got = min(nbytes, self.free(gpu))
        self.others_used[gpu] += got
        self.low[gpu] = min(self.low[gpu], self.free(gpu))
        return got


@dataclass(frozen=True)
class MeasuredRun(WorldRun):
    """A WorldRun of vLLM 0.34 with what a real agent would read besides the GPU's figures."""

    others: tuple[int, ...] = ()  # per GPU, the neighbour's bytes when the pod turned Ready
    others_after: tuple[int, ...] = ()  # per GPU, the neighbour's bytes once this run is over
    warmup: tuple[WarmupMemory, ...] = ()  # per rank, the "Memory after warmup" line's figures
    fell_back: bool = False  # the engine printed extensible_kv_disabled (no VMM)
    engine_measured: bool = False  # the engine sized its KV cache after warm-up


def _gib2(nbytes: int) -> int:
    """A figure as the agent reads it back from vLLM's "%.2f GiB" (0.01 GiB precise)."""
    return int(round(nbytes / GIB, 2) * GIB)


def _warmup(engine: EngineMemoryModel) -> tuple[WarmupMemory, ...]:
    if not isinstance(engine, MeasuredEngineModel):
        return ()
    return tuple(
        WarmupMemory(
            free_bytes=_gib2(m.free_bytes),
            committed_bytes=_gib2(m.committed_bytes),
            kept_bytes=_gib2(m.kept_bytes),
            peak_bytes=_gib2(m.peak_bytes),
            torch_growth_bytes=_gib2(m.torch_growth_bytes),
            blocks=m.blocks,
            blocks_bytes=_gib2(m.blocks_bytes),
            requested_bytes=_gib2(m.requested_bytes),
            torch_cap_bytes=_gib2(m.torch_cap_bytes),
        )
        for m in engine.measurements
    )


def measured_config(case: MeasuredCase, scenario: Scenario, argv: Sequence[str]) -> tuple[EngineConfig, bool]:
    """What `vllm serve ARGV` runs on the case's node (call under `playing(VERSION)`): the
    resolved configuration, and whether the engine fell back for want of VMM."""
    config = engine_config(scenario, argv)
    if case.vmm or not config.extensible_kv_cache:
        return config, False
    facts = extensible_facts()
    assert facts is not None
    util = config.explicit_utilization
    fallback = float(facts["estimate_default_utilization"]) if util is None else util
    return dataclasses.replace(config, extensible_kv_cache=False, gpu_memory_utilization=fallback), True


def _has_connector(argv: Sequence[str]) -> bool:
    with playing(VERSION):
        return bool(getattr(parse_args(argv), "kv_transfer_config", None))


def run_measured(
    case: MeasuredCase, argv: Sequence[str], neighbour: Sequence[int], *, foreseen: bool = False
) -> MeasuredRun:
    """Start `vllm serve ARGV` (vLLM 0.34) on the case's GPUs, the neighbour holding `neighbour`
    bytes per GPU, and walk one full load cycle. `foreseen`: the true fit's world, where the
    neighbour is at its peak and the connector's buffers are held before the engine measures."""
    scenario = load_scenario(case.scenario)
    n = scenario.world_size
    held = list(neighbour)
    connector = case.connector_bytes if _has_connector(argv) else 0
    if foreseen:
        if case.neighbour is not None:
            held[case.neighbour.gpu] = case.neighbour.hold + case.neighbour.grow
        held = [h + connector for h in held]
        connector = 0
    with playing(VERSION):
        config, fell_back = measured_config(case, scenario, argv)
        ledger = _NeighbourLedger([scenario.gpu.total_bytes] * n, held)
        engine = engine_model(scenario, config, ledger)
        failure: EngineFailure | None = None
        ready, cycle_low, seen = False, None, tuple(held)
        idle: tuple[int, ...] = ()
        low: tuple[int, ...] = ()
        running: int | None = None
        try:
            engine.startup()
            for m in engine.ranks:  # the connector, made in extend_kv_cache
                engine._allocate(m.rank, TAG_CONNECTOR, connector, PHASE_EXTEND)
            ready = True
            idle, low, seen = tuple(map(ledger.free, range(n))), tuple(ledger.low), tuple(ledger.others_used)
            for level, running in enumerate(engine.running_levels()):
                if case.neighbour is not None and level == case.neighbour.at_level and not foreseen:
                    wants = case.neighbour.hold + case.neighbour.grow - ledger.others_used[case.neighbour.gpu]
                    ledger.grow(case.neighbour.gpu, max(0, wants))
                engine.begin_step(running)
                engine.end_step()
            cycle_low, running = tuple(ledger.low), None
        except EngineFailure as exc:
            failure = exc
        after = list(ledger.others_used)
        if failure is not None and case.neighbour is not None and not foreseen:
            # the engine let go: the neighbour takes what it waited for
            g = case.neighbour.gpu
            after[g] = max(after[g], min(case.neighbour.hold + case.neighbour.grow, scenario.gpu.total_bytes))
        lines = printed_failure(scenario, failure, at_startup=not ready, plan=engine.plan) if failure else ()
    verdict = _verdict(engine, failure, running)
    if case.clean or (not any(held) and not connector and not fell_back):
        # nothing beside the engine: the world's own outcome must agree (the same model)
        with playing(VERSION):
            world = outcome_for_config(scenario, config)
        if world.crashes != verdict.crashes or world.num_gpu_blocks != verdict.num_gpu_blocks:
            raise AssertionError(
                f"{case.name}: replay disagrees with outcome_for_config() ({world} vs {verdict})"
            )
    return MeasuredRun(
        outcome=verdict,
        ready=ready,
        idle_free=idle,
        startup_min_free=low,
        cycle_min_free=cycle_low,
        failure_lines=tuple(lines),
        startup_free=tuple(engine.snapshot_free) if ready else (),
        argv=tuple(argv),
        others=seen,
        others_after=tuple(after),
        warmup=_warmup(engine),  # printed before extend_kv_cache: read even when that fails
        fell_back=fell_back,
        engine_measured=isinstance(engine, MeasuredEngineModel),
        snapshot_free=tuple(engine.snapshot_free),
        others_at_start=tuple(held),
        others_peak=tuple(max(a, b) for a, b in zip(held, ledger.others_used, strict=True)),
    )


def _verdict(engine: EngineMemoryModel, failure: EngineFailure | None, running: int | None) -> Outcome:
    plan = engine.plan
    blocks = plan.num_gpu_blocks if plan is not None else 0
    tokens = plan.num_tokens if plan is not None else 0
    kv = min(plan.kv_bytes) if plan is not None else 0
    if failure is None:
        return Outcome(False, None, kv, None, None, num_gpu_blocks=blocks, kv_tokens=tokens)
    return Outcome(
        True,
        failure.rank,
        kv,
        failure.requested_bytes,
        failure.free_bytes,
        reason=failure.reason,
        phase=failure.phase,
        running_seqs=running,
        num_gpu_blocks=blocks,
        kv_tokens=tokens,
        message=failure.message(),
    )


# ---------------------------------------------------------------------------------------------
# What the agent reports, and rankguard's loop over it


def measured_report(case: MeasuredCase, run: MeasuredRun, base: Report, peak: Sequence[int]) -> Report:
    """`base` (the GPU figures, the probe, the engine's start-up free memory) with what a real
    agent adds on vLLM 0.34: the neighbour as others (its bytes now and its peak since this agent
    started), each rank's "Memory after warmup" figures, the node's VMM, no IMEX channel (the
    bench's pods have none) and the engine's fallback reason. Round-tripped through JSON."""
    ranks = []
    for s in base.ranks:
        held = run.others[s.rank] if run.others else 0
        procs = [OtherProcess(NEIGHBOUR_PID, NEIGHBOUR_NAME, held)] if held else []
        ranks.append(
            dataclasses.replace(
                s,
                others_bytes=held,
                others_peak_bytes=max(held, peak[s.rank]),
                others=procs,
                warmup=run.warmup[s.rank] if run.warmup else None,
                free_at_load_bytes=run.snapshot_free[s.rank] if run.snapshot_free else None,
                others_at_load_bytes=run.others_at_start[s.rank] if run.others_at_start else None,
            )
        )
    report = dataclasses.replace(
        base,
        ranks=ranks,
        engine_version=VERSION,
        vmm=case.vmm,
        imex_channel=False,
        extensible_disabled=NO_VMM_REASON if run.fell_back else None,
    )
    return parse_report(report.to_json())


class MeasuredLoop(RankguardLoop):
    """RankguardLoop whose agent reports what vLLM 0.34's agent reports, from the last run."""

    def __init__(self, case: MeasuredCase, spec_doc: dict[str, Any]) -> None:
        self.case = case
        self.last: MeasuredRun | None = None
        super().__init__(load_scenario(case.scenario), spec_doc=spec_doc)

    def report(
        self,
        free: Sequence[int],
        min_free: Sequence[int],
        startup_free: Sequence[int],
        *,
        probe: bool,
        pod: str,
    ) -> Report:
        base = agent_report(self.scenario, free, min_free, self.now, probe=probe, startup_free=startup_free)
        assert self.last is not None
        return measured_report(self.case, self.last, base, self.last.others)


def measured_spec(case: MeasuredCase) -> dict[str, Any]:
    """The 0.34 service: the KV table's spec with the 0.34 image, the block size left to the
    engine (0.34's default 64, as vanilla runs) and the case's connector in extraArgs."""
    doc = spec_for(load_scenario(case.scenario))
    doc["image"] = IMAGE
    engine = dict(doc["engine"])
    engine.pop("blockSize", None)
    if case.connector_bytes:
        engine["extraArgs"] = ["--kv-transfer-config", json.dumps(CONNECTOR)]
    doc["engine"] = engine
    return doc


def vanilla_argv(case: MeasuredCase) -> list[str]:
    argv = utilization_argv(load_scenario(case.scenario), 1.0)[:-2]  # the utilisation unset
    if case.connector_bytes:
        argv += ["--kv-transfer-config", json.dumps(CONNECTOR)]
    return argv


@dataclass
class World:
    """One strategy's world for a case: the neighbour's bytes carry over from run to run."""

    case: MeasuredCase
    loop: MeasuredLoop | None = None
    neighbour: list[int] = field(default_factory=list)
    runs: list[MeasuredRun] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = load_scenario(self.case.scenario).world_size
        nb = self.case.neighbour
        self.neighbour = [nb.hold if nb is not None and g == nb.gpu else 0 for g in range(n)]

    def __call__(self, argv: Sequence[str]) -> MeasuredRun:
        run = run_measured(self.case, argv, self.neighbour)
        self.neighbour = list(run.others_after)
        self.runs.append(run)
        if self.loop is not None:
            self.loop.last = run
        return run
