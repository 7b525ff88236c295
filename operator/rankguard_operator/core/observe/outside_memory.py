"""What the agents say that an engine measuring its own KV cache (vLLM 0.34) cannot see, and what
the engine said of its measurement: per rank, memory other processes hold on its GPU (now, at
their peak, and when the engine's worker started loading weights, with the free memory then) and
the "Memory after warmup" figures; per service, whether every node has virtual memory management
and every pod an IMEX channel, and whether the engine fell back to estimates.

What status.sizing keeps of it (core/status/sizing.py writes it, `kept` reads it back) stands in
for a pass whose pods do not report: a crashed engine's agent says nothing until it runs again,
and the decision about that crash needs what it said before.

Pure: reads validated reports (rankguard_agent.wire.report), no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rankguard_operator.core.budget.reserve import OutsideRank
from rankguard_operator.core.observe.headroom import ReportInput
from rankguard_operator.core.units import format_bytes


@dataclass(frozen=True)
class Outside:
    ranks: tuple[OutsideRank, ...] = ()
    warmup: tuple[dict[str, Any], ...] = ()  # status rows, one per rank that printed its line
    vmm: bool | None = None  # False: some node lacks it; True: every reporting node has it
    imex_channel: bool | None = None  # False: some pod has none; True: every reporting pod has one
    engine_disabled: str | None = None  # the engine's own reason for falling back to estimates


def _all_or_any_false(values: Sequence[bool | None]) -> bool | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return all(known)


def _count(row: Mapping[str, Any], key: str) -> int | None:
    v = row.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _kept_rank(row: Any) -> OutsideRank | None:
    if not isinstance(row, Mapping):
        return None
    values = [_count(row, k) for k in ("rank", "totalBytes", "othersBytes", "othersPeakBytes")]
    if any(v is None for v in values):
        return None
    rank, total, now, peak = (int(v or 0) for v in values)
    largest = row.get("largestOther")
    return OutsideRank(
        rank,
        str(row.get("pod", "")),
        str(row.get("uuid", "")),
        total,
        now,
        peak,
        largest if isinstance(largest, str) else None,
        free_at_load_bytes=_count(row, "freeAtLoadBytes"),
        others_at_load_bytes=_count(row, "othersAtLoadBytes"),
    )


def kept(doc: Any) -> Outside:
    """status.sizing as `core/status/sizing.sizing_status` wrote it. What does not read is
    skipped: status is ours, but a person can edit it."""
    if not isinstance(doc, Mapping):
        return Outside()
    rows = doc.get("ranks")
    ranks = [r for r in (_kept_rank(x) for x in (rows if isinstance(rows, list) else [])) if r is not None]

    def flag(key: str) -> bool | None:
        v = doc.get(key)
        return v if isinstance(v, bool) else None

    disabled = doc.get("engineDisabled")
    return Outside(
        ranks=tuple(sorted(ranks, key=lambda r: r.rank)),
        vmm=flag("vmm"),
        imex_channel=flag("imexChannel"),
        engine_disabled=disabled if isinstance(disabled, str) and disabled else None,
    )


def _rank(pod: str, s: Any, before: OutsideRank | None) -> OutsideRank:
    top = max(s.others, key=lambda p: p.bytes, default=None)
    peak = max(s.others_peak_bytes or 0, s.others_bytes, 0 if before is None else before.others_peak_bytes)
    found = OutsideRank(
        rank=s.rank,
        pod=pod,
        uuid=s.uuid,
        total_bytes=s.total_bytes,
        others_bytes=s.others_bytes,
        others_peak_bytes=peak,
        biggest=None if top is None else f"pid {top.pid} ({top.name}) {format_bytes(top.bytes)}",
        free_at_load_bytes=s.free_at_load_bytes,
        others_at_load_bytes=s.others_at_load_bytes,
    )
    if before is None:
        return found
    # an engine start not seen yet in this pod (the agent restarted with it): the last one seen
    if found.free_at_load_bytes is None:
        found = replace(
            found,
            free_at_load_bytes=before.free_at_load_bytes,
            others_at_load_bytes=before.others_at_load_bytes,
        )
    return found if found.biggest is not None else replace(found, biggest=before.biggest)


def outside(reports: Sequence[ReportInput], before: Outside | None = None) -> Outside:
    """The newest report of each rank wins (reports arrive per pod; a rank lives in one pod); a
    rank no report speaks of keeps what status kept, and a peak never falls below the kept one
    (a new pod's agent starts its own peak). The pod-level answers of this pass's reports win;
    without any, the kept ones stand."""
    before = before or Outside()
    ranks: dict[int, OutsideRank] = {r.rank: r for r in before.ranks}
    warm: dict[int, dict[str, Any]] = {}
    for pod, report, _ in sorted(reports, key=lambda r: r[2]):
        for s in report.ranks:
            if s.others_bytes is not None:
                ranks[s.rank] = _rank(pod, s, ranks.get(s.rank))
            w = s.warmup
            if w is not None:
                warm[s.rank] = {
                    "rank": s.rank,
                    "freeBytes": w.free_bytes,
                    "committedBytes": w.committed_bytes,
                    "keptBytes": w.kept_bytes,
                    "blocks": w.blocks,
                    "requestedBytes": w.requested_bytes,
                    "torchCapBytes": w.torch_cap_bytes,
                }
    vmm = _all_or_any_false([r.vmm for _, r, _ in reports])
    imex = _all_or_any_false([r.imex_channel for _, r, _ in reports])
    disabled = next((r.extensible_disabled for _, r, _ in reports if r.extensible_disabled), None)
    return Outside(
        ranks=tuple(ranks[k] for k in sorted(ranks)),
        warmup=tuple(warm[k] for k in sorted(warm)),
        vmm=before.vmm if vmm is None else vmm,
        imex_channel=before.imex_channel if imex is None else imex,
        engine_disabled=disabled or before.engine_disabled,
    )
