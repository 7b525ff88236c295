"""The agent's `/report` document: the one contract between the agent and the operator.

The agent builds it with `Report.to_json()`; the operator parses untrusted bytes with
`parse_report()`, which either returns a fully validated `Report` or raises `ReportError`.
Anything malformed is "no data" for the operator, never a reason to act (DESIGN §5).

The engine fields (`engine_version`, `unparsed_lines`, per rank `engine_memory`), `model` (the
served model's config.json and checkpoint headers, `report_model`) and the memory fields of
`report_memory` (per rank `others*`, `warmup`, `*_at_load_bytes`; for the pod `vmm`,
`imex_channel`, `extensible_disabled`) are advisory: one that is malformed is dropped
alone and named in `Report.dropped_fields` (the operator counts those), while the rest of the
report stands. Everything else malformed rejects the whole report.

Ranks are vLLM's GLOBAL ranks. A pod of a multi-node group (vLLM's `--nnodes`) says where it
sits (`nnodes`, `node_rank`, `local_world_size`, `tp_size`, `pp_size`) and, per rank, its
`local_rank` (the pod's GPU index), pipeline `stage` and `tp_rank`; `parse_report` checks them
against each other (global = node_rank × local_world_size + local_rank, stage = global //
(world / pp_size), tp_rank = global % tp_size). A report without them is one node's: its ranks
are its GPUs 0..N-1 (local = global) and the reader derives a stage or TP rank when it needs one
(`rankguard_agent.wire.group.GroupPlace`).

Standard library only: this module runs inside the vLLM container and inside the operator.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rankguard_agent.wire.group import (
    MAX_GROUP_RANKS,
    MAX_NNODES,
    MAX_RANKS,
    GroupError,
    GroupFields,
    check_pod_ranks,
)
from rankguard_agent.wire.report_memory import (
    OtherProcess,
    WarmupMemory,
    parse_pod_memory,
    parse_rank_memory,
)
from rankguard_agent.wire.report_model import ModelReport, ModelReportError, parse_model

REPORT_VERSION = 1
# A TP-64 report with KV lines is ~20 KiB; `model` adds at most a 256 KiB config.json and
# 4096 layers of figures (~350 KiB); anything far beyond that is hostile or broken.
MAX_REPORT_BYTES = 1024 * 1024
MAX_TEXT = 1024
# Largest believable GPU memory figure (1 PiB); bigger numbers are garbage, not GPUs.
MAX_BYTES = 1 << 50
MAX_ENGINE_VERSION = 64


class ReportError(ValueError):
    """The document is not a valid agent report. The message says which field and why."""


@dataclass(frozen=True)
class EngineMemory:
    """What the engine itself said about one rank's memory (vLLM's per-worker lines).

    From the worker memory report (printed only when --kv-cache-memory-bytes is not set),
    and/or `cuda_graph_bytes` alone from the "CUDA graph pool memory" line. None = not said.
    GiB figures are 0.01 GiB precise; the two `kv_to_*` figures are vLLM's exact bytes."""

    consumed_bytes: int | None = None  # weights + non-torch (CUDA context, NCCL, ...)
    peak_activation_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    kv_in_use_bytes: int | None = None
    free_at_start_bytes: int | None = None  # free on the device when the worker started
    total_bytes: int | None = None
    requested_bytes: int | None = None  # total × gpu_memory_utilization
    kv_to_requested_bytes: int | None = None  # --kv-cache-memory that fits the request (may be < 0)
    kv_to_gpu_bytes: int | None = None  # --kv-cache-memory that fills the GPU (may be < 0)


@dataclass(frozen=True)
class RankSample:
    """One rank's memory as NVML (or the simulated GPU) reports it."""

    rank: int
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    min_free_bytes: int  # minimum free over the last `window_seconds`: transient peaks are short
    window_seconds: float
    error: str | None = None  # e.g. "GpuIsLost": the figures are then the last good ones, or 0
    engine_memory: EngineMemory | None = None  # the engine's own account, once it printed one
    # In a multi-node group (None on one node, where local = global = `rank`):
    local_rank: int | None = None  # the pod's GPU index (vLLM's local rank)
    stage: int | None = None  # pipeline stage (PP rank)
    tp_rank: int | None = None  # rank within its tensor-parallel group
    # What the engine cannot see (wire/report_memory.py): memory on this GPU held by processes
    # that are not this pod's, None = unknown; its most since the agent started; the largest few.
    others_bytes: int | None = None
    others_peak_bytes: int | None = None
    others: list[OtherProcess] = field(default_factory=list)
    warmup: WarmupMemory | None = None  # this rank's "Memory after warmup" line (vLLM 0.34)
    # Free memory and others_bytes when the rank began loading weights (vLLM's init snapshot)
    free_at_load_bytes: int | None = None
    others_at_load_bytes: int | None = None


@dataclass(frozen=True)
class ProbeRank:
    """Per-rank result of the startup probe (free memory around NCCL/communicator init)."""

    rank: int
    free_before_bytes: int
    free_after_bytes: int
    comm_bytes: int  # memory the communicator took: the rank's NCCL + context cost
    error: str | None = None
    local_rank: int | None = None  # in a multi-node group: the pod's GPU index (`rank` is global)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    backend: str  # "nccl" or "gloo"
    world_size: int
    ranks: list[ProbeRank] = field(default_factory=list)
    error: str | None = None
    duration_seconds: float = 0.0


@dataclass(frozen=True)
class KVLine:
    """The last vLLM KV-cache line recognised in the engine's output."""

    kind: str  # "available_kv_memory" | "kv_cache_tokens" | "max_concurrency" | "kv_too_small"
    text: str
    value: float
    timestamp: float


@dataclass(frozen=True)
class Report:
    version: int
    agent_version: str
    timestamp: float
    ranks: list[RankSample]
    probe: ProbeResult | None = None
    kv_lines: list[KVLine] = field(default_factory=list)
    sampler_ok: bool = True
    engine_version: str | None = None  # the vLLM the launcher started (package metadata), if known
    # engine lines the agent saw but could not read, by kind (rankguard_agent_unparsed_lines_total)
    unparsed_lines: dict[str, int] = field(default_factory=dict)
    model: ModelReport | None = None  # the served model's files, once the agent read them
    # The pod's place in a vLLM multi-node group; all None on one node.
    nnodes: int | None = None  # pods in the group (vLLM's --nnodes)
    node_rank: int | None = None  # this pod's --node-rank
    local_world_size: int | None = None  # vLLM ranks per pod: global = node_rank × this + local
    tp_size: int | None = None
    pp_size: int | None = None
    # vLLM 0.34's extensible KV cache (wire/report_memory.py): whether the node's driver has GPU
    # virtual memory management, whether an IMEX channel opens in this pod (None: no GPU
    # backend), and the reason the engine gave when it turned the extensible KV cache off.
    vmm: bool | None = None
    imex_channel: bool | None = None
    extensible_disabled: str | None = None
    # Set by parse_report only, never sent: "where: why" for each engine field it dropped.
    dropped_fields: list[str] = field(default_factory=list)

    def to_json(self) -> bytes:
        doc = asdict(self)
        del doc["dropped_fields"]
        doc["model"] = None if self.model is None else self.model.to_doc()
        return json.dumps(doc, separators=(",", ":")).encode()


def _obj(doc: Any, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ReportError(f"{where}: expected an object, got {type(doc).__name__}")
    return doc


def _int(doc: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    v = doc.get(key)
    # bool is an int in Python; a report saying `true` bytes is broken.
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReportError(f"{where}.{key}: expected an integer, got {v!r:.40}")
    if not lo <= v <= hi:
        raise ReportError(f"{where}.{key}: {v} is outside [{lo}, {hi}]")
    return v


def _opt_int(doc: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int | None:
    return None if doc.get(key) is None else _int(doc, key, where, lo, hi)


def _num(doc: dict[str, Any], key: str, where: str, lo: float = 0.0, hi: float = 1e12) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ReportError(f"{where}.{key}: expected a finite number, got {v!r:.40}")
    if not lo <= v <= hi:
        raise ReportError(f"{where}.{key}: {v} is outside [{lo}, {hi}]")
    return float(v)


def _str(doc: dict[str, Any], key: str, where: str, optional: bool = False) -> str | None:
    v = doc.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise ReportError(f"{where}.{key}: expected a string, got {v!r:.40}")
    if len(v) > MAX_TEXT:
        raise ReportError(f"{where}.{key}: longer than {MAX_TEXT} characters")
    return v


def _list(doc: dict[str, Any], key: str, where: str, limit: int) -> list[Any]:
    v = doc.get(key, [])
    if not isinstance(v, list):
        raise ReportError(f"{where}.{key}: expected a list")
    if len(v) > limit:
        raise ReportError(f"{where}.{key}: more than {limit} entries")
    return v


_ENGINE_MEMORY_FIELDS = (
    "consumed_bytes",
    "peak_activation_bytes",
    "cuda_graph_bytes",
    "kv_in_use_bytes",
    "free_at_start_bytes",
    "total_bytes",
    "requested_bytes",
    "kv_to_requested_bytes",
    "kv_to_gpu_bytes",
)
# vLLM computes these as differences: negative when nothing fits under that limit.
_SIGNED = ("kv_to_requested_bytes", "kv_to_gpu_bytes")


def _engine_memory(doc: Any, where: str) -> EngineMemory | None:
    if doc is None:
        return None
    d = _obj(doc, where)
    figures = {
        k: None if d.get(k) is None else _int(d, k, where, -MAX_BYTES if k in _SIGNED else 0)
        for k in _ENGINE_MEMORY_FIELDS
    }
    mem = EngineMemory(**figures)
    free, total = mem.free_at_start_bytes, mem.total_bytes
    if free is not None and total is not None and free > total:
        raise ReportError(f"{where}: free_at_start_bytes exceeds total_bytes")
    return mem


def _engine_version(d: dict[str, Any], dropped: list[str]) -> str | None:
    v = d.get("engine_version")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ENGINE_VERSION:
        dropped.append(f"report.engine_version: expected a version string, got {v!r:.40}")
        return None
    return v


MAX_UNPARSED_KINDS = 16


def _unparsed(d: dict[str, Any], dropped: list[str]) -> dict[str, int]:
    v = d.get("unparsed_lines")
    if v is None:
        return {}
    ok = (
        isinstance(v, dict)
        and len(v) <= MAX_UNPARSED_KINDS
        and all(isinstance(k, str) and 0 < len(k) <= 64 for k in v)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_BYTES for n in v.values())
    )
    if not ok:
        dropped.append(f"report.unparsed_lines: expected {{kind: count}}, got {v!r:.60}")
        return {}
    return dict(v)


def _model(d: dict[str, Any], dropped: list[str]) -> ModelReport | None:
    try:
        return parse_model(d.get("model"))
    except ModelReportError as e:
        dropped.append(str(e))
        return None


def _group(d: dict[str, Any]) -> GroupFields:
    w = "report"
    try:
        return GroupFields(
            nnodes=_opt_int(d, "nnodes", w, 1, MAX_NNODES),
            node_rank=_opt_int(d, "node_rank", w, 0, MAX_NNODES - 1),
            local_world=_opt_int(d, "local_world_size", w, 1, MAX_RANKS),
            tp=_opt_int(d, "tp_size", w, 1, MAX_GROUP_RANKS),
            pp=_opt_int(d, "pp_size", w, 1, MAX_GROUP_RANKS),
        )
    except GroupError as e:
        raise ReportError(f"report: {e}") from None


def _rank(doc: Any, where: str, dropped: list[str], g: GroupFields) -> RankSample:
    d = _obj(doc, where)
    try:
        engine_memory = _engine_memory(d.get("engine_memory"), f"{where}.engine_memory")
    except ReportError as e:
        engine_memory = None
        dropped.append(str(e))
    rank = _int(d, "rank", where, 0, g.rank_limit - 1)
    local = _opt_int(d, "local_rank", where, 0, (g.local_world or MAX_RANKS) - 1)
    stage = _opt_int(d, "stage", where, 0, (g.pp or MAX_GROUP_RANKS) - 1)
    tp_rank = _opt_int(d, "tp_rank", where, 0, (g.tp or MAX_GROUP_RANKS) - 1)
    _check_rank(g, where, rank, local, stage=stage, tp=tp_rank)
    memory = parse_rank_memory(d, where, dropped)
    s = RankSample(
        rank=rank,
        uuid=_str(d, "uuid", where) or "",
        total_bytes=_int(d, "total_bytes", where),
        used_bytes=_int(d, "used_bytes", where),
        free_bytes=_int(d, "free_bytes", where),
        min_free_bytes=_int(d, "min_free_bytes", where),
        window_seconds=_num(d, "window_seconds", where, 0.0, 86400.0),
        error=_str(d, "error", where, optional=True),
        engine_memory=engine_memory,
        local_rank=local,
        stage=stage,
        tp_rank=tp_rank,
        others_bytes=memory.others_bytes,
        others_peak_bytes=memory.others_peak_bytes,
        others=memory.others or [],
        warmup=memory.warmup,
        free_at_load_bytes=memory.free_at_load_bytes,
        others_at_load_bytes=memory.others_at_load_bytes,
    )
    if s.error is None and (s.free_bytes > s.total_bytes or s.min_free_bytes > s.free_bytes):
        raise ReportError(f"{where}: free/min_free exceed total/free ({s.free_bytes}, {s.min_free_bytes})")
    return s


def _probe(doc: Any, g: GroupFields) -> ProbeResult | None:
    if doc is None:
        return None
    d = _obj(doc, "probe")
    ranks = []
    for i, r in enumerate(_list(d, "ranks", "probe", MAX_RANKS)):
        w = f"probe.ranks[{i}]"
        rd = _obj(r, w)
        rank = _int(rd, "rank", w, 0, g.rank_limit - 1)
        local = _opt_int(rd, "local_rank", w, 0, MAX_RANKS - 1)
        _check_rank(g, w, rank, local)
        ranks.append(
            ProbeRank(
                rank=rank,
                free_before_bytes=_int(rd, "free_before_bytes", w),
                free_after_bytes=_int(rd, "free_after_bytes", w),
                comm_bytes=_int(rd, "comm_bytes", w, -MAX_BYTES),
                error=_str(rd, "error", w, optional=True),
                local_rank=local,
            )
        )
    ok = d.get("ok")
    if not isinstance(ok, bool):
        raise ReportError("probe.ok: expected true or false")
    return ProbeResult(
        ok=ok,
        backend=_str(d, "backend", "probe") or "",
        world_size=_int(d, "world_size", "probe", 0, MAX_RANKS),
        ranks=ranks,
        error=_str(d, "error", "probe", optional=True),
        duration_seconds=_num(d, "duration_seconds", "probe", 0.0, 86400.0),
    )


def _kv(doc: Any, where: str) -> KVLine:
    d = _obj(doc, where)
    return KVLine(
        kind=_str(d, "kind", where) or "",
        text=_str(d, "text", where) or "",
        value=_num(d, "value", where, -1e18, 1e18),
        timestamp=_num(d, "timestamp", where),
    )


def _check_rank(
    g: GroupFields,
    where: str,
    rank: int,
    local: int | None,
    *,
    stage: int | None = None,
    tp: int | None = None,
) -> None:
    try:
        g.check_rank(rank, local, stage, tp)
    except GroupError as e:
        raise ReportError(f"{where}: {e}") from None


def parse_report(raw: bytes) -> Report:
    """Validate untrusted bytes from an agent. Raises ReportError with a precise reason."""
    if len(raw) > MAX_REPORT_BYTES:
        raise ReportError(f"report is {len(raw)} bytes, over the {MAX_REPORT_BYTES}-byte limit")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ReportError(f"report is not UTF-8 JSON: {e}") from None
    d = _obj(doc, "report")
    version = _int(d, "version", "report", 0, 1000)
    if version != REPORT_VERSION:
        raise ReportError(f"report.version {version} is not supported (this operator reads {REPORT_VERSION})")
    dropped: list[str] = []
    group = _group(d)
    ranks = [
        _rank(r, f"report.ranks[{i}]", dropped, group)
        for i, r in enumerate(_list(d, "ranks", "report", MAX_RANKS))
    ]
    try:
        check_pod_ranks([(r.rank, r.local_rank) for r in ranks], group.first_rank)
    except GroupError as e:
        raise ReportError(f"report.ranks: {e}") from None
    pod_memory = parse_pod_memory(d, dropped)
    sampler_ok = d.get("sampler_ok", True)
    if not isinstance(sampler_ok, bool):
        raise ReportError("report.sampler_ok: expected true or false")
    return Report(
        version=version,
        agent_version=_str(d, "agent_version", "report") or "",
        timestamp=_num(d, "timestamp", "report"),
        ranks=sorted(ranks, key=lambda r: r.rank),
        probe=_probe(d.get("probe"), group),
        kv_lines=[_kv(k, f"report.kv_lines[{i}]") for i, k in enumerate(_list(d, "kv_lines", "report", 16))],
        sampler_ok=sampler_ok,
        engine_version=_engine_version(d, dropped),
        unparsed_lines=_unparsed(d, dropped),
        model=_model(d, dropped),
        nnodes=group.nnodes,
        node_rank=group.node_rank,
        local_world_size=group.local_world,
        tp_size=group.tp,
        pp_size=group.pp,
        vmm=pod_memory.vmm,
        imex_channel=pod_memory.imex_channel,
        extensible_disabled=pod_memory.extensible_disabled,
        dropped_fields=dropped,
    )
