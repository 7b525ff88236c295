"""Per-rank headroom: many agents' reports -> one `Observation` the policy and status read.

Every replica runs every rank, so rank r exists once per pod. What matters for a per-GPU
budget (one value for all ranks and all replicas) is the WORST replica of each rank: the
lowest minimum free memory seen over the agent's sampling window. The bottleneck is the rank
whose worst figure is lowest; it is computed, never assumed to be rank 0 (DESIGN §1).

Freshness: a report received more than `stale_after` seconds ago, a report whose sampler is
not healthy, and a rank sample carrying an error (GPU lost) are kept for display, marked
stale, and never used for a decision (DESIGN §5).

Callers should pass only reports from pods running the current template: a pod that still
runs the previous flags describes the previous budget.

Pure: no I/O, no clock (`now` is an argument).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rankguard_agent.wire.recognisers import AVAILABLE_KV
from rankguard_agent.wire.report import EngineMemory, Report
from rankguard_operator.core.budget.planner import RankMeasurement

ReportInput = tuple[str, Report, float]  # (pod name, validated report, received_at epoch seconds)


@dataclass(frozen=True)
class EngineFigures:
    """One rank's memory as vLLM's worker reported it at start-up ("Free memory on device ...
    Actual usage is ..."), reduced to what the planner needs.

    non_kv_bytes: everything on the device but the KV pool at the engine's worst profiled
    moment: memory others held when the worker started (total − free at start: other CUDA
    contexts on the GPU, e.g. the API server's on GPU 0) + the worker's own weights and
    non-torch memory + peak activation + CUDA graphs."""

    non_kv_bytes: int
    consumed_bytes: int
    peak_activation_bytes: int
    cuda_graph_bytes: int
    free_at_start_bytes: int
    total_bytes: int


def engine_figures(m: EngineMemory | None) -> EngineFigures | None:
    """The planner's view of an agent's engine_memory; None unless every figure needed is there
    and they add up (a garbled line must not move a budget)."""
    if m is None:
        return None
    need = (m.consumed_bytes, m.peak_activation_bytes, m.free_at_start_bytes, m.total_bytes)
    if any(v is None or v < 0 for v in need):
        return None
    consumed, peak, free, total = (int(v or 0) for v in need)
    graphs = max(0, m.cuda_graph_bytes or 0)
    if free > total or total <= 0:
        return None
    non_kv = (total - free) + consumed + peak + graphs
    if non_kv > total:
        return None
    return EngineFigures(non_kv, consumed, peak, graphs, free, total)


def _free_at_start(m: EngineMemory | None, total: int) -> int | None:
    free = None if m is None else m.free_at_start_bytes
    return free if free is not None and 0 < free <= total else None


@dataclass(frozen=True)
class RankHeadroom:
    """One rank's worst replica. `headroom_bytes` is the lowest free memory in the window."""

    rank: int
    uuid: str
    pod: str
    total_bytes: int
    free_bytes: int
    min_free_bytes: int
    stale: bool = False
    error: str | None = None
    # vLLM's own per-worker memory report for this rank (agent's engine_memory), when printed
    engine: EngineFigures | None = None
    # the free memory vLLM's worker measured at start-up (its report, or the line it prints
    # instead with a byte budget); kept apart: it comes without the rest on byte-budget starts
    engine_free_at_start: int | None = None

    @property
    def headroom_bytes(self) -> int:
        return self.min_free_bytes


@dataclass(frozen=True)
class Observation:
    """What the agents said, aggregated. `ranks` holds fresh ranks and, for ranks with no fresh
    data, their last stale figures (marked); decisions use only `fresh_ranks`."""

    now: float
    ranks: tuple[RankHeadroom, ...] = ()
    fresh_pods: tuple[str, ...] = ()
    stale_pods: tuple[str, ...] = ()
    # the probe's free memory after CUDA/NCCL init, worst replica per rank, ok probes only
    measurements: tuple[RankMeasurement, ...] = ()
    # vLLM's "Available KV cache memory" as printed by the engines (lowest over fresh pods)
    kv_cache_bytes: int | None = None
    # the vLLM version the agents report (package metadata in the serving image), if any
    engine_version: str | None = None
    # engine lines the agents saw but could not read, by kind, summed over fresh pods
    unparsed_lines: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default_factory=tuple)  # why data was excluded, for status/events

    @property
    def fresh_ranks(self) -> tuple[RankHeadroom, ...]:
        return tuple(r for r in self.ranks if not r.stale)

    @property
    def has_fresh_data(self) -> bool:
        return any(not r.stale for r in self.ranks)

    @property
    def stale_count(self) -> int:
        return len(self.stale_pods)

    @property
    def bottleneck(self) -> RankHeadroom | None:
        """The fresh rank with the least headroom (ties: the lowest rank), or None."""
        fresh = self.fresh_ranks
        if not fresh:
            return None
        return min(fresh, key=lambda r: (r.min_free_bytes, r.rank))

    @property
    def bottleneck_rank(self) -> int | None:
        b = self.bottleneck
        return None if b is None else b.rank

    @property
    def min_headroom_bytes(self) -> int | None:
        b = self.bottleneck
        return None if b is None else b.min_free_bytes

    def rank(self, index: int) -> RankHeadroom | None:
        for r in self.ranks:
            if r.rank == index:
                return r
        return None


def _worse(a: RankHeadroom | None, b: RankHeadroom) -> RankHeadroom:
    if a is None:
        return b
    # least headroom wins; ties go to the first pod by name so the result never depends on order
    return min(a, b, key=lambda r: (r.min_free_bytes, r.pod))


def aggregate(reports: Sequence[ReportInput], now: float, stale_after: float) -> Observation:
    """Aggregate reports from the pods of one LLMService (one report per pod)."""
    fresh: dict[int, RankHeadroom] = {}
    stale: dict[int, RankHeadroom] = {}
    fresh_pods: list[str] = []
    stale_pods: list[str] = []
    probe_free: dict[int, tuple[int, int | None]] = {}
    kv_seen: list[int] = []
    versions: list[str] = []
    unparsed: dict[str, int] = {}
    notes: list[str] = []
    for pod, report, received_at in sorted(reports, key=lambda x: x[0]):
        age = now - received_at
        too_old = age > stale_after
        if too_old:
            notes.append(f"{pod}: report is {age:.0f}s old (limit {stale_after:g}s)")
        elif not report.sampler_ok:
            notes.append(f"{pod}: the agent's sampler is not healthy")
        pod_fresh = not too_old and report.sampler_ok
        (fresh_pods if pod_fresh else stale_pods).append(pod)
        totals: dict[int, int] = {}
        for s in report.ranks:
            usable = pod_fresh and s.error is None
            if pod_fresh and s.error is not None:
                notes.append(f"{pod}: rank {s.rank}: {s.error}")
            row = RankHeadroom(
                rank=s.rank,
                uuid=s.uuid,
                pod=pod,
                total_bytes=s.total_bytes,
                free_bytes=s.free_bytes,
                min_free_bytes=s.min_free_bytes,
                stale=not usable,
                error=s.error,
                engine=engine_figures(s.engine_memory),
                engine_free_at_start=_free_at_start(s.engine_memory, s.total_bytes),
            )
            if usable:
                fresh[s.rank] = _worse(fresh.get(s.rank), row)
                totals[s.rank] = s.total_bytes
            else:
                stale[s.rank] = _worse(stale.get(s.rank), row)
        if not pod_fresh:
            continue
        if report.engine_version:
            versions.append(report.engine_version)
        for kind, n in report.unparsed_lines.items():
            unparsed[kind] = unparsed.get(kind, 0) + n
        if report.probe is not None and report.probe.ok:
            for p in report.probe.ranks:
                if p.error is not None:
                    continue
                prev = probe_free.get(p.rank)
                if prev is None or p.free_after_bytes < prev[0]:
                    probe_free[p.rank] = (p.free_after_bytes, totals.get(p.rank))
        for line in report.kv_lines:
            if line.kind == AVAILABLE_KV and line.value > 0:
                kv_seen.append(int(line.value))
    rows = [fresh[r] for r in sorted(fresh)] + [stale[r] for r in sorted(stale) if r not in fresh]
    measurements = tuple(
        RankMeasurement(rank=r, total_bytes=total, free_after_init_bytes=free)
        for r, (free, total) in sorted(probe_free.items())
        # a probe figure above the device's total is garbage; the planner would refuse it
        if total is None or free <= total
    )
    return Observation(
        now=now,
        ranks=tuple(sorted(rows, key=lambda r: r.rank)),
        fresh_pods=tuple(fresh_pods),
        stale_pods=tuple(stale_pods),
        measurements=measurements,
        kv_cache_bytes=min(kv_seen) if kv_seen else None,
        # pods of one template run one image: the lowest version reported, for determinism
        engine_version=min(versions) if versions else None,
        unparsed_lines=unparsed,
        notes=tuple(notes),
    )


def gpu_totals(
    observation: Observation | None, engine_non_kv: Mapping[int, int] | None = None
) -> tuple[RankMeasurement, ...]:
    """Each fresh rank's device total as a planner measurement (when no probe ran, the total
    alone still replaces spec.memory.gpuMemoryBytes), merged with the probe figures and the
    engine's own non-KV figure per rank (`engine_non_kv`, as kept in status)."""
    if observation is None:
        return ()
    probe = {m.rank: m for m in observation.measurements}
    engine = dict(engine_non_kv or {})
    out = []
    for r in observation.fresh_ranks:
        m = probe.get(r.rank)
        out.append(
            RankMeasurement(
                rank=r.rank,
                total_bytes=r.total_bytes,
                free_after_init_bytes=None if m is None else m.free_after_init_bytes,
                engine_non_kv_bytes=engine.get(r.rank),
            )
        )
    return tuple(out)


def learned_gpu_bytes(
    observation: Observation | None, world_size: int, crash_totals: Sequence[int | None] = ()
) -> int | None:
    """One GPU's total as the agents measure it (NVML), once every rank of a replica has said:
    the smallest total, so a mixed node plans for its smallest card. Before any report, the
    device total a crash's termination message carried (`crash_totals`: vLLM's start-up
    refusal prints it, and a pod refused at start-up never becomes ready to be scraped).
    None until one of them is known."""
    totals = {
        r.rank: r.total_bytes for r in (observation.fresh_ranks if observation else ()) if r.total_bytes
    }
    if len(totals) >= world_size:
        return min(totals.values())
    crashed = [t for t in crash_totals if t is not None and t > 0]
    return min(crashed) if crashed else None
