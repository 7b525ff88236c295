"""What an LLMService's `.status` carries from one operator pass to the next, typed.

Status is written by rankguard, but a person can edit it: every reader here turns what it
cannot use into "nothing" rather than an error, so a bad status never crashes a pass.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.budget.gpu_labels import NodeGpu
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.resolve import LearnedModel
from rankguard_operator.core.observe.memory_trend import MemoryTrend
from rankguard_operator.core.policy.history import STATUS_ACTIONS
from rankguard_operator.core.units import parse_iso


def _since(v: Any) -> float | None:
    """A clock kept in status: RFC 3339 as written now, or the epoch seconds an older operator
    wrote (read once, then written back as RFC 3339)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return parse_iso(v)


@dataclass(frozen=True)
class PendingRemediation:
    """A flag change decided and written down, maybe not yet rolled (`status.pendingRemediation`)."""

    id: str
    kind: str  # the action, as the CRD names it (history.STATUS_ACTIONS: ShrinkKVCache, ...)
    started_at: str
    from_flags: ServingFlags | None
    to_flags: ServingFlags | None
    terminations: tuple[str, ...] = ()
    record: Mapping[str, Any] | None = None  # the history entry to keep once it has rolled

    def to_status(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": STATUS_ACTIONS.get(self.kind, self.kind),
            "startedAt": self.started_at,
            "fromFlags": None if self.from_flags is None else self.from_flags.to_status(),
            "toFlags": None if self.to_flags is None else self.to_flags.to_status(),
            "terminations": list(self.terminations),
            "record": None if self.record is None else dict(self.record),
        }

    @classmethod
    def from_status(cls, doc: Any) -> PendingRemediation | None:
        """None when there is none, or when it is unreadable (status can be edited by hand)."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("id"), str) or not doc["id"]:
            return None
        terms = doc.get("terminations")
        record = doc.get("record")
        return cls(
            id=doc["id"],
            kind=str(doc.get("kind") or ""),
            started_at=str(doc.get("startedAt") or ""),
            from_flags=ServingFlags.from_status(doc.get("fromFlags")),
            to_flags=ServingFlags.from_status(doc.get("toFlags")),
            terminations=tuple(t for t in terms if isinstance(t, str)) if isinstance(terms, list) else (),
            record=dict(record) if isinstance(record, Mapping) else None,
        )


@dataclass(frozen=True)
class ServiceState:
    """The typed view of what `.status` carries between passes. `raw` is the status as read,
    kept for the conditions' transition times and for writing only what changed."""

    serving_flags: ServingFlags | None = None
    last_known_good: ServingFlags | None = None
    handled: tuple[str, ...] = ()
    history: tuple[Mapping[str, Any], ...] = ()
    pending: PendingRemediation | None = None
    low_headroom_since: float | None = None
    ample_headroom_since: float | None = None
    ample_headroom_lowest: int | None = None  # the bottleneck's least free bytes in that stretch
    unschedulable_since: float | None = None  # core/observe/blockers' clock
    stuck_since: float | None = None  # core/observe/pod_blockers' clock
    budget_key: str | None = None
    gpu_memory_bytes: int | None = None  # learned from the agents (budget.learned_gpu_bytes)
    # status.nodeGpu: one GPU's size as the serving pods' nodes' labels last stated it; the
    # labels are read from the nodes the pods run on, so with no pod (a group replace scales
    # every set to zero) only this copy remains, and the render must not change for want of it
    node_gpu: NodeGpu | None = None
    # status.engine (core/status/engine): vLLM's own per-rank memory rows, kept from the
    # start-up that printed them (only a start without --kv-cache-memory-bytes does), and the
    # least free memory a worker found at start-up, both for the budget key they were measured
    # under; read them through `kept_engine`
    engine_rows: tuple[Mapping[str, Any], ...] = ()
    engine_budget_key: str | None = None
    startup_free_bytes: int | None = None
    # the most weight bytes another process held on one GPU when vLLM refused to start for them
    # ("Externally held weights on device ..."), same budget key; read through `kept_engine`
    external_weight_bytes: int | None = None
    service_applied: bool = False
    observed_generation: int | None = None
    learned_model: LearnedModel | None = None  # status.model: what an agent read from the pod
    # status.memoryTrend: the tightest rank's headroom while serving (core/observe/memory_trend);
    # the MemoryCreep condition only, the policy never reads it
    memory_trend: MemoryTrend | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)

    def kept_engine(self, key: str) -> tuple[tuple[Mapping[str, Any], ...], int | None, int | None]:
        """(status.engine's per-rank rows, its start-up free memory, the weights another process
        held) when they were measured under budget key `key`; nothing once the spec's budget
        inputs have changed."""
        if self.engine_budget_key != key:
            return (), None, None
        return self.engine_rows, self.startup_free_bytes, self.external_weight_bytes

    @property
    def engine_non_kv(self) -> dict[int, int]:
        """The kept rows as {rank: the engine's non-KV bytes} (whatever their budget key)."""
        return {int(r["rank"]): int(r["nonKVBytes"]) for r in self.engine_rows}

    @classmethod
    def from_status(cls, doc: Mapping[str, Any] | None) -> ServiceState:
        s = dict(doc or {})
        handled = s.get("handledTerminations")
        history = s.get("remediations")
        gen = s.get("observedGeneration")
        raw_engine = s.get("engine")
        engine: Mapping[str, Any] = raw_engine if isinstance(raw_engine, Mapping) else {}
        return cls(
            serving_flags=ServingFlags.from_status(s.get("servingFlags")),
            last_known_good=ServingFlags.from_status(s.get("lastKnownGood")),
            handled=tuple(k for k in handled if isinstance(k, str)) if isinstance(handled, list) else (),
            history=tuple(dict(h) for h in history if isinstance(h, Mapping))
            if isinstance(history, list)
            else (),
            pending=PendingRemediation.from_status(s.get("pendingRemediation")),
            low_headroom_since=_since(s.get("lowHeadroomSince")),
            ample_headroom_since=_since(s.get("ampleHeadroomSince")),
            ample_headroom_lowest=_positive_int(s.get("ampleHeadroomLowestBytes")),
            unschedulable_since=_since(s.get("unschedulableSince")),
            stuck_since=_since(s.get("stuckSince")),
            budget_key=s.get("budgetKey") if isinstance(s.get("budgetKey"), str) else None,
            gpu_memory_bytes=_positive_int(s.get("gpuMemoryBytes")),
            node_gpu=NodeGpu.from_status(s.get("nodeGpu")),
            engine_rows=_engine_rows(engine),
            engine_budget_key=_str(engine.get("budgetKey")),
            startup_free_bytes=_positive_int(engine.get("startupFreeBytes")),
            external_weight_bytes=_positive_int(engine.get("externalWeightBytes")),
            service_applied=s.get("serviceApplied") is True,
            observed_generation=gen if isinstance(gen, int) and not isinstance(gen, bool) else None,
            learned_model=LearnedModel.from_status(s.get("model")),
            memory_trend=MemoryTrend.from_status(s.get("memoryTrend")),
            raw=s,
        )


def _positive_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _engine_rows(doc: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    """status.engine.ranks[], the rows with a valid rank and nonKVBytes (a person can edit
    status: anything malformed is skipped, never trusted)."""
    rows = doc.get("ranks")
    if not isinstance(rows, list):
        return ()
    out = []
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        rank = row.get("rank")
        if (
            isinstance(rank, int)
            and not isinstance(rank, bool)
            and rank >= 0
            and _positive_int(row.get("nonKVBytes"))
        ):
            out.append(dict(row))
    return tuple(out)
