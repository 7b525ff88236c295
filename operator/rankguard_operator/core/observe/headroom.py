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

from rankguard_agent.wire.recognisers import AVAILABLE_KV, KV_TOKENS, MAX_CONCURRENCY
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
    # vLLM's "KV cache size: N tokens" and "Maximum concurrency ...: Xx" (lowest over fresh pods):
    # what one replica holds as the engine counts it (core/status/capacity)
    kv_cache_tokens: int | None = None
    kv_max_concurrency: float | None = None
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


# One pod's report as aggregate reads it: (pod name, report, why it is stale; None when fresh)
_Read = tuple[str, Report, str | None]


def aggregate(reports: Sequence[ReportInput], now: float, stale_after: float) -> Observation:
    """Aggregate reports from the pods of one LLMService (one report per pod)."""
    read: list[_Read] = [
        (pod, report, _staleness(report, now - received_at, stale_after))
        for pod, report, received_at in sorted(reports, key=lambda x: x[0])
    ]
    fresh = [report for _pod, report, why in read if why is None]
    versions = [r.engine_version for r in fresh if r.engine_version]
    return Observation(
        now=now,
        ranks=_worst_ranks(read),
        fresh_pods=tuple(pod for pod, _report, why in read if why is None),
        stale_pods=tuple(pod for pod, _report, why in read if why is not None),
        measurements=_probe_measurements(fresh),
        kv_cache_bytes=_int_or_none(_lowest_kv_line(fresh, AVAILABLE_KV)),
        kv_cache_tokens=_int_or_none(_lowest_kv_line(fresh, KV_TOKENS)),
        kv_max_concurrency=_lowest_kv_line(fresh, MAX_CONCURRENCY),
        # pods of one template run one image: the lowest version reported, for determinism
        engine_version=min(versions) if versions else None,
        unparsed_lines=_unparsed_lines(fresh),
        notes=tuple(note for pod, report, why in read for note in _notes(pod, report, why)),
    )


def _staleness(report: Report, age: float, stale_after: float) -> str | None:
    """Why a pod's report may not be used for a decision; None when it may."""
    if age > stale_after:
        return f"report is {age:.0f}s old (limit {stale_after:g}s)"
    if not report.sampler_ok:
        return "the agent's sampler is not healthy"
    return None


def _notes(pod: str, report: Report, why_stale: str | None) -> list[str]:
    """Why data of one pod was excluded: the whole report, or (a fresh one) its lost ranks."""
    if why_stale is not None:
        return [f"{pod}: {why_stale}"]
    return [f"{pod}: rank {s.rank}: {s.error}" for s in report.ranks if s.error is not None]


def _worst_ranks(read: Sequence[_Read]) -> tuple[RankHeadroom, ...]:
    """Each rank's worst replica: from fresh samples, or (a rank with none) from stale ones, marked."""
    fresh: dict[int, RankHeadroom] = {}
    stale: dict[int, RankHeadroom] = {}
    for pod, report, why in read:
        for s in report.ranks:
            row = RankHeadroom(
                rank=s.rank,
                uuid=s.uuid,
                pod=pod,
                total_bytes=s.total_bytes,
                free_bytes=s.free_bytes,
                min_free_bytes=s.min_free_bytes,
                stale=why is not None or s.error is not None,
                error=s.error,
                engine=engine_figures(s.engine_memory),
                engine_free_at_start=_free_at_start(s.engine_memory, s.total_bytes),
            )
            worst = stale if row.stale else fresh
            worst[s.rank] = _worse(worst.get(s.rank), row)
    rows = [fresh[r] for r in sorted(fresh)] + [stale[r] for r in sorted(stale) if r not in fresh]
    return tuple(sorted(rows, key=lambda r: r.rank))


def _probe_measurements(fresh: Sequence[Report]) -> tuple[RankMeasurement, ...]:
    """The probe's free memory after CUDA/NCCL init, worst replica per rank, ok probes only,
    with the device total of the rank's fresh sample in the same report."""
    probe_free: dict[int, tuple[int, int | None]] = {}
    for report in fresh:
        if report.probe is None or not report.probe.ok:
            continue
        totals = {s.rank: s.total_bytes for s in report.ranks if s.error is None}
        for p in report.probe.ranks:
            prev = probe_free.get(p.rank)
            if p.error is None and (prev is None or p.free_after_bytes < prev[0]):
                probe_free[p.rank] = (p.free_after_bytes, totals.get(p.rank))
    return tuple(
        RankMeasurement(rank=r, total_bytes=total, free_after_init_bytes=free)
        for r, (free, total) in sorted(probe_free.items())
        # a probe figure above the device's total is garbage; the planner would refuse it
        if total is None or free <= total
    )


def _lowest_kv_line(fresh: Sequence[Report], kind: str) -> float | None:
    """One engine figure of `kind` as the engines printed it ("Available KV cache memory", "KV
    cache size", "Maximum concurrency"): the lowest over fresh pods (the replica that holds
    least is the one a request may land on)."""
    seen = [line.value for r in fresh for line in r.kv_lines if line.kind == kind and line.value > 0]
    return min(seen) if seen else None


def _int_or_none(v: float | None) -> int | None:
    return None if v is None else int(v)


def _unparsed_lines(fresh: Sequence[Report]) -> dict[str, int]:
    """The engine lines the agents saw but could not read, by kind, summed over fresh pods."""
    unparsed: dict[str, int] = {}
    for report in fresh:
        for kind, n in report.unparsed_lines.items():
            unparsed[kind] = unparsed.get(kind, 0) + n
    return unparsed


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
